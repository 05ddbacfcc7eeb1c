"""The thin asyncio shell every DeadPool process shares: NATS connection policy, validated
subscriptions, and running until a signal. Stands on `deadpool_protocol`; knows no service."""

from deadpool_runtime.bus import connect, publish, server_urls, subscribe_validated
from deadpool_runtime.clock_fault import install_from_env as _install_clock_fault
from deadpool_runtime.events import EventPublisher, EventReader, ensure_events_stream
from deadpool_runtime.lifecycle import run_nats_service, run_service, stopped_within

_install_clock_fault()  # the chaos benchmark's clock_step fault; nothing without its variable

__all__ = [
    "EventPublisher",
    "EventReader",
    "connect",
    "ensure_events_stream",
    "publish",
    "run_nats_service",
    "run_service",
    "server_urls",
    "stopped_within",
    "subscribe_validated",
]
