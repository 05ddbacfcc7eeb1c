"""The swapper's part of each incident's trace (`deadpool_runtime.tracing`): `recovery`, from the fault
to every rank's first step after it, with `decide` and `fence` under it.

`recovery` is begun when the incident's rebuild is first published, as a child of the detector's
`detect` span (the failure's traceparent), so the rebuild carries its context to the members and
stores; it ends when the incident closes. A swapper that takes over a rebuild in flight begins its own
`recovery` under the same `detect`: the trace stays one. Several failures swapped in one rebuild keep
a trace each; the rebuild carries the first one's.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from deadpool_protocol import Incident
from deadpool_runtime.tracing import Tracing, seconds_to_ns, traceparent_of

if TYPE_CHECKING:
    from opentelemetry.trace import Span

__all__ = ["IncidentTracer"]

OPEN_SPANS_MAX = 10_000
"""Recovery spans begun and not yet ended (an incident that never closes is dropped, oldest first)."""


class IncidentTracer:
    def __init__(self, trace_file: str = "") -> None:
        self.tracing = Tracing("deadpool-swapper", trace_file)
        self._open: OrderedDict[str, Span] = OrderedDict()

    def recovery_context(self, incident_id: str, failure_traceparent: str, t_fault: float, job: str) -> str:
        """The traceparent a rebuild answering `incident_id` carries: its `recovery` span, begun at the
        fault the first time it is asked for ('' with tracing off)."""
        if not self.tracing.on or not incident_id:
            return ""
        span = self._open.get(incident_id)
        if span is None:
            span = self.tracing.start("recovery", failure_traceparent, t_fault, {"incident": incident_id, "job": job})
            if span is None:
                return ""
            self._open[incident_id] = span
            while len(self._open) > OPEN_SPANS_MAX:
                self._open.popitem(last=False)[1].end()
        return traceparent_of(span)

    def record(self, incident: Incident) -> None:
        """The incident closed: end its `recovery` span (begin one if this swapper never published its
        rebuild) and add `decide` and `fence` under it. Once per incident (the caller sees to it)."""
        if not self.tracing.on:
            return
        attrs: dict[str, Any] = {
            "incident": incident.incident_id,
            "job": incident.job,
            "generation": incident.generation,
            "rank": incident.rank,
            "member": incident.member,
            "replacement": incident.replacement,
            "reason": incident.reason,
            "restore_step": incident.restore_step,
            "lost_steps": incident.lost_steps,
            "downtime_s": incident.downtime_s,
        }
        self.recovery_context(incident.incident_id, incident.traceparent, incident.t_fault, incident.job)
        recovery = self._open.pop(incident.incident_id)
        recovery.set_attributes(attrs)
        parent = traceparent_of(recovery)
        fence_s = incident.phases.get("fence", 0.0)
        self.tracing.record("decide", parent, incident.t_detected, incident.t_decided, attrs)
        self.tracing.record("fence", parent, incident.t_decided, incident.t_decided + fence_s, attrs)
        recovery.end(end_time=seconds_to_ns(max(incident.t_fault, incident.t_first_step or incident.t_resumed)))

    def shutdown(self) -> None:
        for span in self._open.values():
            span.end()
        self._open.clear()
        self.tracing.shutdown()
