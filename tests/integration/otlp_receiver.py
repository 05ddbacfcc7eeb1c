"""A real OTLP/HTTP receiver for tests: the protocol a collector speaks, on a loopback port.

It accepts `POST /v1/traces` with an `ExportTraceServiceRequest` and `POST /v1/metrics` with an
`ExportMetricsServiceRequest` (protobuf, gzip or not), keeps every span and the (service, metric name)
of every metric it received, and answers as a collector does.
"""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["OtlpReceiver", "ReceivedSpan"]

BODY_BYTES_MAX = 16 * 1024 * 1024


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    """`with OtlpReceiver() as receiver:` listens on 127.0.0.1; `receiver.endpoint` is the base URL."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metrics: set[tuple[str, str]] = set()
        """(service, metric name) of every metric received."""
        self.requests = 0
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                kinds: dict[str, tuple[Any, Any]] = {
                    "/v1/traces": (ExportTraceServiceRequest, ExportTraceServiceResponse),
                    "/v1/metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
                }
                if self.path not in kinds or not 0 < length <= BODY_BYTES_MAX:
                    self.send_error(404 if self.path not in kinds else 413)
                    return
                body = self.rfile.read(length)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request_type, response_type = kinds[self.path]
                request = request_type()
                request.ParseFromString(body)
                if self.path == "/v1/traces":
                    receiver._take(request)
                else:
                    receiver._take_metrics(request)
                answer = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    def _take(self, request: Any) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self.changed:
            self.spans += spans
            self.requests += 1
            self.changed.notify_all()

    def _take_metrics(self, request: Any) -> None:
        names = set()
        for resource_metrics in request.resource_metrics:
            resource = {a.key: _value(a.value) for a in resource_metrics.resource.attributes}
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    names.add((str(resource.get("service.name", "")), metric.name))
        with self.changed:
            self.metrics |= names
            self.requests += 1
            self.changed.notify_all()

    def wait_for(self, predicate: Any, timeout_s: float) -> bool:
        """Block until `predicate(spans)` holds (True) or `timeout_s` passes (False)."""
        with self.changed:
            return bool(self.changed.wait_for(lambda: predicate(list(self.spans)), timeout_s))

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
