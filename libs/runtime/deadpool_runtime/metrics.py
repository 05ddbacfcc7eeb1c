"""Metrics, with the OpenTelemetry metrics API: exported over OTLP and, on request, as a Prometheus
endpoint (the OTel Prometheus exporter).

Configuration is OpenTelemetry's own: `OTEL_METRICS_EXPORTER` (`otlp`, `prometheus`, `none`, or a
comma-separated list), OTLP over HTTP to `OTEL_EXPORTER_OTLP_METRICS_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_METRIC_EXPORT_INTERVAL`; the Prometheus endpoint listens on
`OTEL_EXPORTER_PROMETHEUS_HOST`:`OTEL_EXPORTER_PROMETHEUS_PORT` (default 127.0.0.1:9464). With neither
named nor an OTLP endpoint set, metrics are off and every instrument is a no-op.

What each part measures:
- members: `deadpool.step.duration` (s), `deadpool.hook.stall` (s: the training thread inside the
  hooks), `deadpool.snapshot.bytes` (bytes captured);
- the swapper: `deadpool.recoveries` (by reason), `deadpool.recovery.downtime` (s, fault to every
  rank's first step), `deadpool.job.committed_step`, `deadpool.job.commit_lag` (steps stored past the
  committed one), `deadpool.job.spares_free`;
- stores: `deadpool.store.memory.used`, `deadpool.store.memory.capacity` and
  `deadpool.store.memory.pooled` (bytes: buffers faulted in for the next uploads).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from deadpool_runtime.tracing import service_resource

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, Observation
    from opentelemetry.sdk.metrics import MeterProvider

__all__ = ["Metrics", "metric_readers"]

PROMETHEUS_HOST_DEFAULT = "127.0.0.1"
PROMETHEUS_PORT_DEFAULT = 9464


def metric_readers(env: Mapping[str, str] | None = None) -> list[Any]:
    """The metric readers the standard variables name (empty: metrics off)."""
    env = os.environ if env is None else env
    named = {n.strip().lower() for n in env.get("OTEL_METRICS_EXPORTER", "").split(",") if n.strip()}
    endpoint = env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if "none" in named:
        return []
    unknown = named - {"otlp", "prometheus"}
    if unknown:
        raise ValueError(f"OTEL_METRICS_EXPORTER={','.join(sorted(unknown))}: use otlp, prometheus or none")
    readers: list[Any] = []
    if "otlp" in named or (not named and endpoint):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if "prometheus" in named:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST", PROMETHEUS_HOST_DEFAULT)
        port = int(env.get("OTEL_EXPORTER_PROMETHEUS_PORT", PROMETHEUS_PORT_DEFAULT))
        start_http_server(port, addr=host)
        readers.append(PrometheusMetricReader())
    return readers


class Metrics:
    """One process's meter (a no-op one when no exporter is configured)."""

    def __init__(self, service_name: str, env: Mapping[str, str] | None = None) -> None:
        from opentelemetry.metrics import NoOpMeter

        self._provider: MeterProvider | None = None
        self.meter: Meter = NoOpMeter(f"deadpool.{service_name}")
        readers = metric_readers(env)
        if not readers:
            return
        from opentelemetry.sdk.metrics import MeterProvider

        self._provider = MeterProvider(metric_readers=readers, resource=service_resource(service_name, env))
        self.meter = self._provider.get_meter(f"deadpool.{service_name}")

    @property
    def on(self) -> bool:
        return self._provider is not None

    def gauge(
        self, name: str, unit: str, description: str, observe: Callable[[], Iterable[tuple[float, dict[str, Any]]]]
    ) -> None:
        """An observable gauge whose values (value, attributes) `observe` gives at each collection."""
        from opentelemetry.metrics import Observation

        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, attributes) for value, attributes in observe()]

        self.meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
