"""One OpenTelemetry trace per incident: root span `recovery`, children for each phase.

Spans are built after the fact from the incident's time marks (explicit start and end times), so the
trace shows what happened even though the phases ran in several processes. Exporters: OTLP when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set and the OTLP exporter package is installed, else JSON lines to
the file given with `--trace-file`, else nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import IO, Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer, set_span_in_context

from deadpool_protocol import Incident

__all__ = ["IncidentTracer", "JsonLinesExporter"]

PHASE_ORDER = ("detect", "decide", "fence", "notify", "restore", "rendezvous", "apply", "first_step")


class JsonLinesExporter(SpanExporter):
    """Writes each finished span as one JSON line (the OTel SDK's own JSON form, compacted)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the process)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            self._file.write(json.dumps(json.loads(span.to_json())) + "\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


def _exporter(trace_file: str) -> SpanExporter | None:
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[import-not-found]
        except ImportError:
            pass
        else:
            exporter: SpanExporter = OTLPSpanExporter()
            return exporter
    return JsonLinesExporter(trace_file) if trace_file else None


def _ns(t: float) -> int:
    return int(t * 1e9)


class IncidentTracer:
    def __init__(self, trace_file: str = "") -> None:
        exporter = _exporter(trace_file)
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        if exporter is not None:
            self._provider = TracerProvider(resource=Resource.create({"service.name": "deadpool-swapper"}))
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
            self._tracer = self._provider.get_tracer("deadpool.swapper")

    def record(self, incident: Incident) -> None:
        if self._tracer is None:
            return
        attrs: dict[str, Any] = {
            "job": incident.job,
            "generation": incident.generation,
            "rank": incident.rank,
            "member": incident.member,
            "replacement": incident.replacement,
            "reason": incident.reason,
            "restore_step": incident.restore_step,
            "lost_steps": incident.lost_steps,
        }
        root = self._tracer.start_span("recovery", start_time=_ns(incident.t_fault), attributes=attrs)
        ctx = set_span_in_context(root)
        start = incident.t_fault
        for name in PHASE_ORDER:
            duration = incident.phases.get(name, 0.0)
            if name == "notify":
                start = incident.t_decided + incident.phases.get("fence", 0.0)
            span = self._tracer.start_span(name, context=ctx, start_time=_ns(start), attributes=attrs)
            span.end(end_time=_ns(start + duration))
            start += duration
        abort = self._tracer.start_span("abort", context=ctx, start_time=_ns(incident.t_fault), attributes=attrs)
        abort.end(end_time=_ns(incident.t_fault + incident.phases.get("abort", 0.0)))
        root.end(end_time=_ns(incident.t_first_step or incident.t_resumed))  # to the first step, if known

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
