"""`deadpool timeline`: one recovery drawn as a Gantt chart, processes by phases, from a trace file.

The trace file holds the JSON-lines spans every process wrote (`deadpool_runtime.tracing`). A recovery
is one trace: the detector's `detect`, the swapper's `recovery`, `decide` and `fence`, each member's
`abort`, `restore`, `rendezvous`, `apply` and `first_step`, and the stores' `serve_restore`. Each
process measured its own spans with its own clock: on one host they line up; across hosts they are as
good as the hosts' clock sync.
"""

from __future__ import annotations

import datetime
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deadpool_protocol.errors import DeadPoolError

__all__ = ["PHASES", "PlotsMissingError", "SpanRecord", "draw", "pick_trace", "read_spans"]

PLOTS_INSTALL = "pip install 'deadpool-hotswap[plots]'"


class PlotsMissingError(DeadPoolError, ImportError):
    """matplotlib, the optional `plots` extra, is not installed: no picture, and nothing else lost."""


PHASES = ("detect", "decide", "fence", "abort", "restore", "serve_restore", "rendezvous", "apply", "first_step")
LINE_CHARS_MAX = 1 << 20
"""A longer line is not a span of ours: skipped."""


@dataclass(frozen=True)
class SpanRecord:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    service: str
    start: float
    end: float
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def row(self) -> str:
        """The chart's row: one per process that took part."""
        if self.service == "deadpool-member":
            return f"rank {self.attributes.get('rank', '?')} ({self.attributes.get('member', '?')})"
        if self.service == "deadpool-store":
            return f"store, for rank {self.attributes.get('rank', '?')}"
        return self.service.removeprefix("deadpool-")


def _seconds(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def read_spans(path: Path) -> list[SpanRecord]:
    """Every span in a JSON-lines trace file (lines that are not one are skipped)."""
    spans = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if len(line) > LINE_CHARS_MAX:
                continue
            try:
                raw = json.loads(line)
                spans.append(
                    SpanRecord(
                        name=str(raw["name"]),
                        trace_id=str(raw["context"]["trace_id"]),
                        span_id=str(raw["context"]["span_id"]),
                        parent_id=str(raw.get("parent_id") or ""),
                        service=str(raw.get("resource", {}).get("attributes", {}).get("service.name", "")),
                        start=_seconds(raw["start_time"]),
                        end=_seconds(raw["end_time"]),
                        attributes=dict(raw.get("attributes") or {}),
                    )
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return spans


def pick_trace(spans: list[SpanRecord], incident: str = "") -> list[SpanRecord]:
    """The spans of incident `incident`'s trace, or of the last recovery's; raises LookupError."""
    recoveries = [s for s in spans if s.name == "recovery"]
    if incident:
        recoveries = [s for s in recoveries if s.attributes.get("incident") == incident]
        if not recoveries:
            raise LookupError(f"no recovery of incident {incident!r} in the trace file")
    if not recoveries:
        raise LookupError("no recovery in the trace file")
    chosen = max(recoveries, key=lambda s: s.start)
    return [s for s in spans if s.trace_id == chosen.trace_id]


def draw(trace: list[SpanRecord], out: Path) -> None:
    """A Gantt chart of `trace` into `out`: .png, or .html (the chart inline, with a table of spans).
    Raises PlotsMissingError without matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsMissingError(f"drawing needs matplotlib, which {PLOTS_INSTALL} adds") from exc

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Rectangle

    phases = [s for s in trace if s.name in PHASES]
    if not phases:
        raise LookupError("the trace holds no phase spans")
    recovery = next((s for s in trace if s.name == "recovery"), None)
    t0 = min(s.start for s in trace)
    rows = sorted({s.row for s in phases}, key=_row_order)
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(PHASES)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(rows)))
    for s in phases:
        y = rows.index(s.row)
        ax.barh(y, max(s.end - s.start, 1e-4), left=s.start - t0, height=0.6, color=colors[s.name])
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the fault")
    if recovery is not None:
        ax.axvline(recovery.end - t0, color="black", linewidth=0.8, linestyle="--")
        title = (
            f"incident {recovery.attributes.get('incident', '?')}: rank {recovery.attributes.get('rank', '?')} "
            f"{recovery.attributes.get('reason', '')}, {recovery.end - recovery.start:.3f} s to every rank's first step"
        )
        ax.set_title(title, fontsize=10)
    used = [name for name in PHASES if any(s.name == name for s in phases)]
    ax.legend(
        [Rectangle((0, 0), 1, 1, color=colors[name]) for name in used],
        used,
        loc="upper right",
        fontsize=8,
        ncols=min(len(used), 5),
    )
    fig.tight_layout()
    if out.suffix == ".png":
        fig.savefig(out, dpi=120)
    elif out.suffix == ".html":
        svg = io.StringIO()
        fig.savefig(svg, format="svg")
        out.write_text(_page(svg.getvalue(), phases, t0))
    else:
        plt.close(fig)
        raise ValueError(f"{out}: write a .png or an .html")
    plt.close(fig)


def _row_order(row: str) -> tuple[int, str]:
    order = {"detector": 0, "swapper": 1}
    if row in order:
        return order[row], row
    if row.startswith("rank "):
        rank = row.split()[1]
        return 2, rank.zfill(6)
    return 3, row


def _page(svg: str, phases: list[SpanRecord], t0: float) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(s.row)}</td><td>{html.escape(s.name)}</td>"
        f"<td>{s.start - t0:.4f}</td><td>{s.end - s.start:.4f}</td></tr>"
        for s in sorted(phases, key=lambda s: (_row_order(s.row), s.start))
    )
    return (
        "<!doctype html><meta charset='utf-8'><title>DeadPool recovery</title>"
        f"{svg[svg.find('<svg') :]}<table>"
        f"<tr><th>process</th><th>phase</th><th>start (s)</th><th>length (s)</th></tr>{rows}</table>"
    )
