"""structlog set-up shared by every DeadPool process: JSON lines on stderr.

All components log the same keys (`job`, `generation`, `rank`, `member`, `step`), which are also the
trace attribute names, so one grep follows a member through detector, swapper and hooks.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

__all__ = ["configure_logging", "get_logger"]


def configure_logging(component: str, level: str | None = None) -> None:
    """Send JSON log lines to stderr; the level comes from `level` or DEADPOOL_LOG_LEVEL (default INFO)."""
    name = (level or os.environ.get("DEADPOOL_LOG_LEVEL", "INFO")).upper()
    numeric = logging.getLevelNamesMapping().get(name, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write() per line: several processes often share one log file.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(component=component)


def get_logger(**bound: Any) -> Any:
    """A structlog logger with `bound` keys on every line."""
    return structlog.get_logger().bind(**bound)
