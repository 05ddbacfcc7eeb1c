"""One OpenTelemetry trace per incident: root span `recovery`, children for each phase.

Spans are built after the fact from the incident's time marks (explicit start and end times), so the
trace shows what happened even though the phases ran in several processes. Every span carries the
incident id. They leave through a batch processor, never on the swapper's own path.

Configuration is OpenTelemetry's own (`OTEL_*`): `OTEL_TRACES_EXPORTER` (`otlp`, `console` or
`none`); OTLP over HTTP to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`;
`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_BSP_*` for the batch processor. Without an
exporter named or an endpoint set, JSON lines go to the file given with `--trace-file` (the local
default), else nowhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import IO, Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer, set_span_in_context

from deadpool_protocol import Incident

__all__ = ["IncidentTracer", "JsonLinesExporter", "exporter_for"]

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


def exporter_for(trace_file: str, env: dict[str, str] | None = None) -> SpanExporter | None:
    """The exporter the standard variables name (see the module docstring); None for no traces."""
    env = dict(os.environ) if env is None else env
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if named == "none":
        return None
    if named == "console":
        return ConsoleSpanExporter()
    if named not in ("", "otlp"):
        raise ValueError(f"OTEL_TRACES_EXPORTER={named!r}: use otlp, console or none")
    if named == "otlp" or endpoint:
        return OTLPSpanExporter()  # reads the OTEL_EXPORTER_OTLP_* variables itself
    return JsonLinesExporter(trace_file) if trace_file else None


def _ns(t: float) -> int:
    return int(t * 1e9)


class IncidentTracer:
    def __init__(self, trace_file: str = "") -> None:
        exporter = exporter_for(trace_file)
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        if exporter is not None:
            named = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "deadpool-swapper"}
            self._provider = TracerProvider(resource=Resource.create(named))
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
            self._tracer = self._provider.get_tracer("deadpool.swapper")

    def record(self, incident: Incident) -> None:
        if self._tracer is None:
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
