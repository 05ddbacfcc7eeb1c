"""The root of every exception DeadPool raises: `except DeadPoolError` catches all of ours and
nothing of torch's, NATS's or the user's.

Each of ours also keeps the built-in base it had (`RuntimeError`, `ValueError`, ...), so code that
caught it by that base still does.
"""

from __future__ import annotations

__all__ = ["DeadPoolError"]


class DeadPoolError(Exception):
    """Raised by DeadPool itself; the subclass says which way out it is."""
