"""Traces that span processes: one trace per incident, with spans from every process that took part.

The trace context travels in the messages, as a W3C `traceparent` string: the detector's `detect` span
starts the trace and goes out in the `Failure`; the swapper's `recovery` span (its child) goes out in
the `Rebuild`; members and stores hang their spans under the rebuild's context, and a member hands it to
the store it fetches from in the `Fetch` frame. Spans are made after the fact, with the explicit times a
process measured (each process's own clock), and leave through a batch processor, never on a hot path.

Configuration is OpenTelemetry's own (`OTEL_*`): `OTEL_TRACES_EXPORTER` (`otlp`, `console` or `none`);
OTLP over HTTP to `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`;
`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_BSP_*` for the batch processor. Without an
exporter named or an endpoint set, spans are appended as JSON lines to `DEADPOOL_TRACE_FILE` (or a
service's `--trace-file`), one line per span, from every process; without that either, tracing is off
and costs nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deadpool_protocol.messages import TRACEPARENT_CHARS_MAX

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Span, Tracer

__all__ = ["TRACE_FILE_ENV", "Tracing", "exporter_for", "seconds_to_ns", "service_resource"]

TRACE_FILE_ENV = "DEADPOOL_TRACE_FILE"


def seconds_to_ns(t: float) -> int:
    return int(t * 1e9)


def _json_lines_exporter(path: str) -> SpanExporter:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLinesExporter(SpanExporter):
        """Appends each finished span as one JSON line (the SDK's own JSON form, compacted), with one
        `write` per line on an O_APPEND descriptor: processes sharing the file never interleave."""

        def __init__(self) -> None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            for span in spans:
                os.write(self._fd, (json.dumps(json.loads(span.to_json())) + "\n").encode())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            os.close(self._fd)

    return JsonLinesExporter()


def exporter_for(trace_file: str, env: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The exporter the standard variables name (see the module docstring); None for no traces."""
    env = os.environ if env is None else env
    named = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if named == "none":
        return None
    if named == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if named not in ("", "otlp"):
        raise ValueError(f"OTEL_TRACES_EXPORTER={named!r}: use otlp, console or none")
    if named == "otlp" or endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # reads the OTEL_EXPORTER_OTLP_* variables itself
    trace_file = trace_file or env.get(TRACE_FILE_ENV, "")
    return _json_lines_exporter(trace_file) if trace_file else None


class Tracing:
    """One process's tracer (off when no exporter is configured: then every call is a no-op)."""

    def __init__(self, service_name: str, trace_file: str = "", env: Mapping[str, str] | None = None) -> None:
        self._provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        exporter = exporter_for(trace_file, env)
        if exporter is None:
            return
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._provider = TracerProvider(resource=service_resource(service_name, env))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer(f"deadpool.{service_name}")

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def start(self, name: str, parent: str, start_t: float, attributes: Mapping[str, Any]) -> Span | None:
        """A span begun at `start_t` (epoch seconds) under the `parent` traceparent ('' starts a trace);
        the caller ends it. None when tracing is off."""
        if self._tracer is None:
            return None
        return self._tracer.start_span(
            name, context=_context(parent), start_time=seconds_to_ns(start_t), attributes=dict(attributes)
        )

    def record(self, name: str, parent: str, start_t: float, end_t: float, attributes: Mapping[str, Any]) -> str:
        """A finished span [start_t, end_t] under `parent`; returns its own traceparent ('' when off)."""
        span = self.start(name, parent, start_t, attributes)
        if span is None:
            return ""
        span.end(end_time=seconds_to_ns(max(start_t, end_t)))  # clocks of two processes may disagree
        return traceparent_of(span)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()


def service_resource(service_name: str, env: Mapping[str, str] | None = None) -> Any:
    """The OTel resource of this process: `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` where set
    (the SDK reads them), else `service_name`."""
    from opentelemetry.sdk.resources import Resource

    named = {} if (env or os.environ).get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    return Resource.create(named)


def traceparent_of(span: Span | None) -> str:
    """The W3C traceparent of `span` ('' for none)."""
    if span is None:
        return ""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier.get("traceparent", "")


def _context(traceparent: str) -> Any:
    """The OTel context a traceparent names (None: a new trace). A malformed one starts a new trace."""
    if not traceparent or len(traceparent) > TRACEPARENT_CHARS_MAX:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})
