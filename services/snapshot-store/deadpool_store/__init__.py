"""The distributed RAM snapshot store: holds (job, rank, step) snapshots and serves restores."""

from deadpool_store.memory import SnapshotMemory, StoredSnapshot, StoreError
from deadpool_store.service import StoreConfig, main

__all__ = ["SnapshotMemory", "StoreConfig", "StoreError", "StoredSnapshot", "main"]
