// tokenloop dashboard: polls v1/dashboard/state and draws counters, KV blocks, charts, a Gantt of recent
// requests, and replays the newest recorded iteration on the loop diagram. No libraries, no build step.
(function () {
  "use strict";

  var POLL_MS = 1000;
  var ANIMATION_MS = 850; // one iteration's replay; shorter than the poll so replays do not pile up
  var STAGES = []; // the loop's stages in order, as the server names them (state.stages)
  var STAGE_COLORS = { schedule: "#b48cff", kv: "#ffcc4d", execute: "#4fb3ff", sample: "#5fd38d", update: "#ff8ac8", release: "#ff8a5b" };
  var STAGE_TITLES = {
    schedule: "Select runnable work", kv: "Prepare KV capacity", execute: "Execute the selected batch",
    sample: "Sample and stream IDs", update: "Add IDs and do completion checks", release: "Release references",
    unfinished: "Return to scheduling"
  };

  var lastAnimated = 0;
  var animation = null;

  function $(id) { return document.getElementById(id); }

  function fmt(n, digits) {
    if (n === null || n === undefined || isNaN(n)) { return "–"; }
    if (digits !== undefined) { return Number(n).toFixed(digits); }
    return Number(n).toLocaleString("en-US");
  }

  function esc(text) {
    return String(text).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }

  function setCounter(id, value, text) {
    var el = $(id);
    el.dataset.value = String(value);
    el.textContent = text !== undefined ? text : fmt(value);
  }

  function setStatus(ok, text) {
    var el = $("status");
    el.className = "status " + (ok ? "live" : "down");
    $("status-text").textContent = text;
  }

  // ---- counters and KV -------------------------------------------------------------------------------

  function outputRate(state) {
    var its = state.iterations;
    if (!its.length) { return 0; }
    var windowMs = Math.min(5000, Math.max(1, state.now_ms - its[0].start_ms));
    var since = state.now_ms - windowMs;
    var tokens = 0;
    for (var i = 0; i < its.length; i++) { if (its[i].end_ms >= since) { tokens += its[i].sampled; } }
    return tokens / (windowMs / 1000);
  }

  function renderCounters(state) {
    var c = state.counters;
    setCounter("c-waiting", c.waiting);
    setCounter("c-running", c.running);
    setCounter("c-preempted", c.preempted);
    setCounter("c-steps", c.steps);
    setCounter("c-finished", c.finished);
    setCounter("c-aborted", c.aborted);
    setCounter("c-preemptions", c.preemptions);
    var rate = outputRate(state);
    setCounter("c-tok-s", Math.round(rate), fmt(rate, 1));
  }

  function renderKV(kv) {
    if (!kv || !kv.num_blocks) { return; }
    var total = kv.num_blocks;
    $("kv-referenced").style.width = (100 * kv.referenced / total) + "%";
    $("kv-cached").style.width = (100 * kv.cached_free / total) + "%";
    $("kv-free").style.width = (100 * kv.free / total) + "%";
    $("kv-n-referenced").textContent = fmt(kv.referenced);
    $("kv-n-cached").textContent = fmt(kv.cached_free);
    $("kv-n-free").textContent = fmt(kv.free);
    $("kv-hit").textContent = fmt(100 * kv.prefix_cache_hit_rate, 1) + " %";
    $("kv-evictions").textContent = fmt(kv.evictions);
    $("kv-text").textContent = fmt(total) + " blocks of " + kv.block_size + " tokens";
  }

  // ---- the loop diagram ----------------------------------------------------------------------------------

  function loopSteps(it) {
    var s = it.stages_ms;
    var steps = [
      { stage: "schedule", ms: s.schedule, nodes: ["state", "schedule"], edges: ["admit"],
        artifact: "batch of " + it.batch + " requests, " + it.tokens + " tokens (" + it.prefill_tokens +
          " prefill); admitted " + it.admitted + ", preempted " + it.preempted },
      { stage: "kv", ms: s.kv, nodes: ["kv"], edges: ["allocate"],
        artifact: it.blocks_allocated + " blocks allocated, " + it.blocks_reused + " reused from the prefix cache (" +
          it.prefix_hit_tokens + " hit tokens)" },
      { stage: "execute", ms: s.execute, nodes: ["execute"], edges: ["run"],
        artifact: "forward " + fmt(it.forward_ms, 2) + " ms over " + it.tokens + " tokens" },
      { stage: "sample", ms: s.sample, nodes: ["sample"], edges: ["sample-output"],
        artifact: it.sampled + " new tokens sampled and streamed" },
      { stage: "update", ms: s.update, nodes: ["update"], edges: ["update-output"],
        artifact: it.finished + " finished; " + it.running + " running, " + it.waiting + " waiting" }
    ];
    if (it.finished > 0) {
      steps.push({ stage: "release", ms: s.release, nodes: ["release"], edges: ["finished"],
        artifact: it.finished + " request(s) dropped their block references; " + it.free_blocks + " blocks not referenced" });
    }
    if (it.running > 0) {
      steps.push({ stage: "unfinished", ms: 0, nodes: ["schedule"], edges: ["unfinished"],
        artifact: it.running + " unfinished requests return to scheduling" });
    }
    return steps;
  }

  function highlight(step) {
    var actives = document.querySelectorAll("#loop .active");
    for (var i = 0; i < actives.length; i++) { actives[i].classList.remove("active"); }
    if (!step) { return; }
    step.nodes.concat(step.edges).forEach(function (key) {
      var el = $("mechanism-" + key);
      if (el) { el.classList.add("active"); }
    });
  }

  function animate(it) {
    if (animation) { clearTimeout(animation); }
    var steps = loopSteps(it);
    var total = 0;
    steps.forEach(function (st) { total += st.ms; });
    var floor = 70;
    var spare = Math.max(0, ANIMATION_MS - floor * steps.length);
    STAGES.forEach(function (stage) { $("t-" + stage).textContent = fmt(it.stages_ms[stage], 2) + " ms"; });
    $("t-state").textContent = it.batch + " in batch";
    $("loop-iter").textContent = "step #" + it.index + ", " + fmt(it.end_ms - it.start_ms, 2) + " ms";
    var i = 0;
    function next() {
      if (i >= steps.length) { animation = null; return; } // the last stage stays lit until the next replay
      var st = steps[i++];
      highlight(st);
      var title = STAGE_TITLES[st.stage];
      $("stage-text").textContent = "Step #" + it.index + " · " + title + (st.stage === "unfinished" ? "" : " — " + fmt(st.ms, 3) + " ms");
      $("artifact-text").textContent = st.artifact;
      animation = setTimeout(next, floor + (total > 0 ? spare * st.ms / total : 0));
    }
    next();
  }

  // ---- charts (SVG markup strings; the HTML parser puts them in the SVG namespace) ----------------------------

  function svg(width, height, body) {
    return '<svg viewBox="0 0 ' + width + " " + height + '" preserveAspectRatio="none">' + body + "</svg>";
  }

  function renderStageBars(iterations) {
    var its = iterations.slice(-60);
    var W = 600, H = 110, pad = 18;
    var max = 0;
    its.forEach(function (it) {
      var t = 0;
      STAGES.forEach(function (s) { t += it.stages_ms[s]; });
      max = Math.max(max, t);
    });
    var bw = (W - pad) / 60;
    var body = '<line class="axis" x1="' + pad + '" y1="' + (H - 12) + '" x2="' + W + '" y2="' + (H - 12) + '"></line>';
    body += '<text x="0" y="10">' + fmt(max, 1) + "</text>";
    its.forEach(function (it, k) {
      var y = H - 12;
      STAGES.forEach(function (s) {
        var h = max > 0 ? (H - 24) * it.stages_ms[s] / max : 0;
        if (h <= 0) { return; }
        y -= h;
        body += '<rect x="' + (pad + k * bw + 1).toFixed(1) + '" y="' + y.toFixed(1) + '" width="' + Math.max(1, bw - 2).toFixed(1) +
          '" height="' + h.toFixed(2) + '" fill="' + STAGE_COLORS[s] + '"><title>step ' + it.index + " " + s + " " +
          fmt(it.stages_ms[s], 3) + " ms</title></rect>";
      });
    });
    $("stage-bars").innerHTML = svg(W, H, body);
    var legend = "";
    STAGES.forEach(function (s) { legend += '<span><i class="sw" style="background:' + STAGE_COLORS[s] + '"></i>' + s + "</span>"; });
    $("stage-legend").innerHTML = legend;
  }

  function lineChart(el, series, xMin, xMax, unitLabel) {
    var W = 600, H = 130, left = 34, bottom = 16;
    var yMax = 0;
    series.forEach(function (s) { s.points.forEach(function (p) { yMax = Math.max(yMax, p[1]); }); });
    yMax = yMax > 0 ? yMax * 1.1 : 1;
    function x(v) { return left + (W - left - 4) * (v - xMin) / Math.max(1e-9, xMax - xMin); }
    function y(v) { return H - bottom - (H - bottom - 6) * v / yMax; }
    var body = '<line class="axis" x1="' + left + '" y1="' + (H - bottom) + '" x2="' + W + '" y2="' + (H - bottom) + '"></line>' +
      '<line class="axis" x1="' + left + '" y1="4" x2="' + left + '" y2="' + (H - bottom) + '"></line>' +
      '<text x="2" y="12">' + fmt(yMax, yMax < 10 ? 1 : 0) + "</text><text x=\"2\" y=\"" + (H - bottom) + '">0</text>' +
      '<text x="' + left + '" y="' + (H - 3) + '">-' + fmt((xMax - xMin) / 1000, 0) + ' s</text>' +
      '<text x="' + (W - 30) + '" y="' + (H - 3) + '">now</text>';
    series.forEach(function (s) {
      if (!s.points.length) { return; }
      if (s.dots) {
        s.points.forEach(function (p) {
          body += '<circle cx="' + x(p[0]).toFixed(1) + '" cy="' + y(p[1]).toFixed(1) + '" r="2.5" fill="' + s.color + '"><title>' +
            fmt(p[1], 1) + " " + unitLabel + "</title></circle>";
        });
      } else {
        var d = s.points.map(function (p, i) { return (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[1]).toFixed(1); }).join(" ");
        body += '<path d="' + d + '" fill="none" stroke="' + s.color + '" stroke-width="2"></path>';
      }
      body += '<text x="' + (left + 6) + '" y="' + (14 + 12 * series.indexOf(s)) + '" style="fill:' + s.color + '">' + esc(s.name) + "</text>";
    });
    el.innerHTML = svg(W, H, body);
  }

  function renderThroughput(state) {
    var now_s = Math.floor(state.now_ms / 1000);
    var buckets = {};
    state.throughput.forEach(function (b) { buckets[b.t_s] = b; });
    var out = [], batched = [];
    for (var t = now_s - 60; t < now_s; t++) { // the current second is still filling: left out
      var b = buckets[t];
      out.push([t * 1000, b ? b.output_tokens : 0]);
      batched.push([t * 1000, b ? b.batched_tokens : 0]);
    }
    lineChart($("chart-throughput"), [
      { name: "output tok/s", color: "#4fb3ff", points: out },
      { name: "batched tok/s", color: "#8a97a6", points: batched }
    ], (now_s - 60) * 1000, (now_s - 1) * 1000, "tok/s");
  }

  function renderTTFT(state) {
    var since = state.now_ms - 60000;
    var points = state.ttft.filter(function (p) { return p[0] >= since; });
    lineChart($("chart-ttft"), [{ name: "TTFT ms", color: "#ffb347", points: points, dots: true }], since, state.now_ms, "ms");
  }

  // ---- Gantt ---------------------------------------------------------------------------------------------

  function renderGantt(state) {
    var reqs = state.requests.slice(-30);
    var el = $("gantt");
    if (!reqs.length) { el.innerHTML = '<div class="gantt-empty">no requests yet</div>'; return; }
    var now = state.now_ms;
    var start = now;
    reqs.forEach(function (r) { start = Math.min(start, r.arrival_ms); });
    start = Math.max(start, now - 60000);
    var span = Math.max(1, now - start);
    function pct(t) { return Math.max(0, Math.min(100, 100 * (t - start) / span)); }
    function bar(cls, a, b, title) {
      if (a === null || a === undefined) { return ""; }
      var end = b === null || b === undefined ? now : b;
      return '<div class="bar ' + cls + '" style="left:' + pct(a).toFixed(2) + "%;width:" + Math.max(0.15, pct(end) - pct(a)).toFixed(2) +
        '%" title="' + esc(title + ": " + fmt(end - a, 1) + " ms") + '"></div>';
    }
    var html = "";
    reqs.forEach(function (r) {
      var end = r.end_ms !== null ? r.end_ms : null;
      var bars = bar("queue", r.arrival_ms, r.admitted_ms !== null ? r.admitted_ms : end, "queued") +
        bar("prefill", r.admitted_ms, r.first_token_ms !== null ? r.first_token_ms : end, "prefill") +
        bar("decode", r.first_token_ms, r.last_token_ms !== null && end !== null ? r.last_token_ms : end, "decode");
      (r.preempted || []).forEach(function (p) { bars += bar("preempted", p[0], p[1] > p[0] ? p[1] : null, "preempted"); });
      var state = r.finish_reason ? r.finish_reason : r.state;
      html += '<div class="gantt-row" data-request-id="' + esc(r.id) + '" data-state="' + esc(state) + '">' +
        '<div class="id" title="' + esc(r.id) + '">' + esc(r.id) + "</div>" +
        '<div class="track">' + bars + "</div>" +
        '<div class="meta">' + r.prompt_tokens + "→" + r.output_tokens + " tok · " + esc(state) + "</div></div>";
    });
    el.innerHTML = html;
  }

  // ---- polling ------------------------------------------------------------------------------------------------

  function renderReplicas(replicas) {
    var panel = $("replicas-panel");
    if (!replicas || replicas.length < 2) { panel.hidden = true; return; }
    panel.hidden = false;
    var body = $("replicas-body");
    body.textContent = "";
    replicas.forEach(function (r) {
      var row = document.createElement("tr");
      var used = r.num_blocks ? fmt(100 * r.referenced / r.num_blocks, 1) + " %" : "–";
      [r.index, r.running, r.waiting, r.preempted, used,
       fmt(100 * (r.prefix_cache_hit_rate || 0), 1) + " %"].forEach(function (v) {
        var cell = document.createElement("td");
        cell.textContent = String(v);
        row.appendChild(cell);
      });
      body.appendChild(row);
    });
  }

  function render(state) {
    STAGES = state.stages;
    renderCounters(state);
    renderKV(state.kv);
    renderReplicas(state.replicas);
    $("replicas-handoffs").textContent = fmt(state.counters.handoffs || 0);
    renderStageBars(state.iterations);
    renderThroughput(state);
    renderTTFT(state);
    renderGantt(state);
    var its = state.iterations;
    if (its.length && its[its.length - 1].index > lastAnimated) {
      lastAnimated = its[its.length - 1].index;
      animate(its[its.length - 1]);
    }
    var t = state.tracing;
    setStatus(true, "live · tracing " + (t.enabled ? "on" : "off") + ", requests sampled " + fmt(100 * t.sample_rate, 0) + " %");
  }

  // With --api-key the state route wants the key: the page asks for it once and keeps it for this tab only.
  var KEY_STORE = "tokenloop-api-key";
  var waitingForKey = false;

  function askForKey(message) {
    waitingForKey = true;
    $("key-form").hidden = false;
    $("key-input").focus();
    setStatus(false, message);
  }

  $("key-form").addEventListener("submit", function (event) {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
    $("key-input").value = "";
    $("key-form").hidden = true;
    if (waitingForKey) { waitingForKey = false; poll(); }
  });

  function poll() {
    var key = sessionStorage.getItem(KEY_STORE);
    var headers = key ? { "Authorization": "Bearer " + key } : {};
    fetch("v1/dashboard/state", { cache: "no-store", headers: headers })
      .then(function (response) {
        if (response.status === 401) {
          sessionStorage.removeItem(KEY_STORE);
          askForKey(key ? "wrong API key: enter it again" : "this server needs its API key");
          return null;
        }
        if (!response.ok) { throw new Error("state: HTTP " + response.status); }
        return response.json().then(render);
      })
      .catch(function (err) { setStatus(false, String(err.message || err)); })
      .then(function () { if (!waitingForKey) { setTimeout(poll, POLL_MS); } });
  }

  poll();
})();
