"""`deadpool timeline` draws a recovery from a trace file, and `deadpool status` renders a job's view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deadpool_cli.status_view import render
from deadpool_cli.timeline import draw, pick_trace, read_spans

T0 = 1_800_000_000.0


def span_line(
    name: str, trace: str, span: str, parent: str, service: str, start: float, end: float, **attrs: object
) -> str:
    def iso(t: float) -> str:
        import datetime

        return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")

    return json.dumps(
        {
            "name": name,
            "context": {"trace_id": trace, "span_id": span},
            "parent_id": parent or None,
            "start_time": iso(start),
            "end_time": iso(end),
            "attributes": attrs,
            "resource": {"attributes": {"service.name": service}},
        }
    )


def write_trace(path: Path, trace: str, incident: str, t0: float) -> None:
    lines = [
        span_line("detect", trace, "d", "", "deadpool-detector", t0, t0 + 0.01, rank=1),
        span_line("recovery", trace, "r", "d", "deadpool-swapper", t0, t0 + 0.5, incident=incident, rank=1),
        span_line("decide", trace, "c", "r", "deadpool-swapper", t0 + 0.01, t0 + 0.06, incident=incident),
        span_line("serve_restore", trace, "s", "r", "deadpool-store", t0 + 0.1, t0 + 0.12, rank=1, bytes=10),
    ]
    for rank in range(2):
        for i, name in enumerate(("restore", "rendezvous", "apply", "first_step")):
            start = t0 + 0.1 + 0.05 * i
            lines.append(
                span_line(
                    name,
                    trace,
                    f"m{rank}{i}",
                    "r",
                    "deadpool-member",
                    start,
                    start + 0.04,
                    rank=rank,
                    member=f"m{rank}",
                )
            )
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\nnot json\n")


def test_the_last_or_a_named_recovery_is_drawn_as_png_and_html(tmp_path: Path) -> None:
    traces = tmp_path / "traces.jsonl"
    write_trace(traces, "0xaaa", "job-1", T0)
    write_trace(traces, "0xbbb", "job-2", T0 + 60)
    spans = read_spans(traces)
    assert len(spans) == 2 * 12  # the line that is not a span is skipped
    last = pick_trace(spans)
    assert {s.trace_id for s in last} == {"0xbbb"}
    first = pick_trace(spans, "job-1")
    assert {s.trace_id for s in first} == {"0xaaa"}
    with pytest.raises(LookupError):
        pick_trace(spans, "job-9")

    png, page = tmp_path / "t.png", tmp_path / "t.html"
    draw(first, png)
    draw(first, page)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = page.read_text()
    assert "<svg" in text and text.count("<tr>") == 1 + 2 * 4 + 3  # header, member phases, detect/decide/serve
    assert "rank 1 (m1)" in text and "store, for rank 1" in text
    with pytest.raises(ValueError, match="png"):
        draw(first, tmp_path / "t.jpg")


STATE = {
    "job": "j",
    "generation": 3,
    "world_size": 2,
    "committed_step": 41,
    "finished": False,
    "leader": "swapper-a",
    "ranks": ["m0", "m1"],
    "members": {"m0": {"host": "a", "pid": 10}, "m1": {"host": "b", "pid": 11}},
    "spares": ["m2"],
    "stores": [{"store": "s0", "host": "h", "port": 7001, "used_bytes": 2**21, "capacity_bytes": 2**30}],
    "placement": [["s0"], ["s0"]],
    "incidents": [
        {"incident_id": f"j-{i}", "rank": 1, "reason": "exit", "downtime_s": 0.5, "lost_steps": 0} for i in range(8)
    ],
}


def test_status_shows_each_rank_with_its_step_and_heartbeat_age() -> None:
    watched = {"watched": {"m0": {"step": 42, "heartbeat_age_s": 0.04}}, "median_step_s": 0.2}
    lines = render(STATE, watched)
    assert lines[0] == "job j: generation 3, world size 2, committed step 41"
    assert "  rank 0: m0 (host a, pid 10): step 42, heartbeat 0.0 s ago, step time 0.200 s" in lines
    assert "  rank 1: m1 (host b, pid 11): no heartbeat yet, step time 0.200 s" in lines
    assert "  spares: m2" in lines
    assert any("store s0" in line and "2.0 of 1024 MiB" in line and "ranks [0, 1]" in line for line in lines)
    assert sum(line.startswith("  incident") for line in lines) == 5  # the recent ones
    assert any("no detector answered" in line for line in render(STATE, None))


def test_status_shows_the_step_each_ranks_crash_copy_holds() -> None:
    watched = {"watched": {"m0": {"step": 42, "local_step": 41, "heartbeat_age_s": 0.04}}, "median_step_s": 0.2}
    lines = render(STATE, watched)
    assert (
        "  rank 0: m0 (host a, pid 10): step 42 (crash copy: step 41), heartbeat 0.0 s ago, step time 0.200 s" in lines
    )


def test_status_says_loudly_when_no_store_protects_the_job_and_how_many_steps_are_at_risk() -> None:
    unprotected = STATE | {"stores": [], "unprotected": {"since_committed_step": 41, "for_s": 95.0}}
    watched = {
        "watched": {
            "m0": {"rank": 0, "step": 57, "heartbeat_age_s": 0.1},
            "m1": {"rank": 1, "step": 56, "heartbeat_age_s": 0.2},
        },
        "median_step_s": 0.2,
    }
    lines = render(unprotected, watched)
    assert "  stores: none alive" in lines
    (loud,) = [line for line in lines if "UNPROTECTED" in line]
    assert "for 95 s" in loud and "since committed step 41" in loud and "16 step(s) at risk" in loud
    assert not any("UNPROTECTED" in line for line in render(STATE, watched))


def test_status_shows_each_members_phase_and_the_state_of_a_rebuild_under_way() -> None:
    watched = {
        "watched": {
            "m0": {"rank": 0, "step": 42, "heartbeat_age_s": 0.1, "phase": "training", "rebuild_state": ""},
            "m1": {"rank": 1, "step": 40, "heartbeat_age_s": 0.2, "phase": "rebuilding", "rebuild_state": "form"},
            "m2": {"rank": -1, "step": -1, "heartbeat_age_s": 0.3, "phase": "warming", "rebuild_state": ""},
        },
        "median_step_s": 0.2,
    }
    lines = render(STATE, watched)
    assert "  rank 0: m0 (host a, pid 10): training, step 42, heartbeat 0.1 s ago, step time 0.200 s" in lines
    assert "  rank 1: m1 (host b, pid 11): rebuilding (form), step 40, heartbeat 0.2 s ago, step time 0.200 s" in lines
    assert "  spares: m2 (warming)" in lines


def test_without_the_plots_extra_the_demo_reports_without_its_picture_and_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seen by a new user: without matplotlib the demo died with ModuleNotFoundError after both runs,
    and its report was lost."""
    from deadpool_cli.demo import _timeline
    from deadpool_cli.timeline import PlotsMissingError

    trace = tmp_path / "traces.jsonl"
    write_trace(trace, "t1", "i1", T0)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib now raises
    with pytest.raises(PlotsMissingError, match="deadpool-hotswap\\[plots\\]"):
        draw(pick_trace(read_spans(trace)), tmp_path / "t.png")
    assert _timeline(trace, tmp_path / "timeline.png") == ""
    said = capsys.readouterr().out
    assert "deadpool-hotswap[plots]" in said and f"deadpool timeline --trace-file {trace}" in said
    assert not (tmp_path / "timeline.png").exists()
