"""The trace router in a bare FastAPI app over a tiny-model engine: traces, 404s, the dashboard and its state."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.tracing.conftest import GREEDY, PROMPTS, make_engine, run_to_end
from tests.tracing.test_export import check_chrome_trace, check_mechanism_schema
from tokenloop.engine import LLMEngine
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.tracer import Tracer
from tokenloop.serving.trace_routes import make_trace_router


@pytest.fixture(scope="module")
def served(tiny: Checkpoint) -> tuple[TestClient, LLMEngine]:
    engine = make_engine(tiny, Tracer())
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"cmpl-{i}-0", prompt, GREEDY)  # the API's ids: response id + prompt index
    run_to_end(engine)
    app = FastAPI()
    app.include_router(make_trace_router(lambda: engine.tracer))
    return TestClient(app), engine


def test_trace_of_a_request_in_both_formats(served) -> None:
    client, _ = served
    chrome = client.get("/v1/trace/cmpl-0-0", params={"format": "chrome"})
    assert chrome.status_code == 200
    names = check_chrome_trace(chrome.json())
    assert sorted(names.values()) == ["engine loop", "request cmpl-0-0"]
    assert client.get("/v1/trace/cmpl-0-0").json() == chrome.json()  # chrome is the default
    mechanism = client.get("/v1/trace/cmpl-1-0", params={"format": "mechanism"})
    assert mechanism.status_code == 200
    check_mechanism_schema(mechanism.json())
    # A response id finds its first prompt's request.
    assert client.get("/v1/trace/cmpl-1", params={"format": "mechanism"}).json()["title"] == mechanism.json()["title"]
    everything = client.get("/v1/trace")
    assert everything.status_code == 200
    assert len([n for n in check_chrome_trace(everything.json()).values() if n.startswith("request ")]) == len(PROMPTS)


def test_unknown_request_and_bad_format(served) -> None:
    client, _ = served
    missing = client.get("/v1/trace/nobody")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "trace_not_found"
    assert error["param"] == "request_id" and "nobody" in error["message"]
    assert client.get("/v1/trace/cmpl-0-0", params={"format": "svg"}).status_code == 422


def test_tracing_off_answers_404(tiny: Checkpoint) -> None:
    app = FastAPI()
    app.include_router(make_trace_router(lambda: None))
    client = TestClient(app)
    for path in ("/v1/trace/x", "/v1/dashboard/state", "/v1/trace"):
        response = client.get(path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "tracing_disabled"
    assert client.get("/dashboard").status_code == 200  # the page itself still loads and reports the error


def test_dashboard_page_is_self_contained(served) -> None:
    client, _ = served
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    for key in ("state", "schedule", "kv", "execute", "sample", "update", "release", "admit", "allocate", "run",
                "sample-output", "update-output", "unfinished", "finished"):
        assert f'id="mechanism-{key}"' in html  # the loop diagram uses the seed's node and edge ids
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sorted(assets) == ["dashboard/dashboard.css", "dashboard/dashboard.js"]
    bodies = [html]
    for asset in assets:
        response = client.get("/" + asset)
        assert response.status_code == 200
        bodies.append(response.text)
    assert "javascript" in client.get("/dashboard/dashboard.js").headers["content-type"]
    for body in bodies:  # no CDN, no remote font or script: nothing fetched from elsewhere
        assert not re.search(r"https?://", body)
        assert "@import" not in body
    assert client.get("/dashboard/../pyproject.toml").status_code == 404
    assert client.get("/dashboard/secret.py").status_code == 404


def test_dashboard_state(served) -> None:
    client, engine = served
    response = client.get("/v1/dashboard/state")
    assert response.status_code == 200
    state = response.json()
    assert set(state) >= {"now_ms", "counters", "kv", "iterations", "requests", "ttft", "throughput", "tracing"}
    assert {"waiting", "running", "preempted", "steps", "finished"} <= set(state["counters"])
    assert state["counters"]["finished"] == len(PROMPTS) and state["counters"]["steps"] == engine.num_steps
    assert {"referenced", "cached_free", "free", "num_blocks"} <= set(state["kv"])
    assert len(state["requests"]) == len(PROMPTS)
    request = state["requests"][0]
    assert {"arrival_ms", "admitted_ms", "first_token_ms", "last_token_ms", "end_ms"} <= set(request)
    assert state["iterations"][-1]["stages_ms"].keys() == {"schedule", "kv", "execute", "sample", "update", "release"}
