"""The launcher's side of the host-local crash copies (`deadpool.host_copy`): the job's directory in
the host's shared memory, made when the launcher starts and removed when it ends, and the sweep of
directories left by launchers that were killed before they could remove theirs.

No torch here: the launcher starts in a fraction of a second.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["SHM_ROOT", "make_job_dir", "remove_job_dir", "sweep_stale"]

SHM_ROOT = Path("/dev/shm")
DIR_PREFIX = "deadpool-copy-"
PID_FILE = "launcher.pid"


def make_job_dir(job: str, launcher_id: str, root: Path = SHM_ROOT) -> Path:
    """The launcher's directory for the job's crash copies (its members' subdirectories go inside)."""
    path = root / f"{DIR_PREFIX}{job}-{launcher_id}"
    path.mkdir(mode=0o700)
    (path / PID_FILE).write_text(str(os.getpid()))
    return path


def remove_job_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale(log: Any, root: Path = SHM_ROOT) -> list[Path]:
    """Remove the job directories of launchers that are gone (killed before they could remove them)."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for path in root.glob(f"{DIR_PREFIX}*"):
        try:
            pid = int((path / PID_FILE).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or being made
        if _alive(pid):
            continue
        remove_job_dir(path)
        removed.append(path)
        log.info("crash copies of a launcher that is gone removed", path=str(path), pid=pid)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
