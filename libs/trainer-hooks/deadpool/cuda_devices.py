"""Which GPU each member of a host trains on: one device per member, spares included.

A promoted spare needs a GPU of its own: NCCL refuses two ranks on one device, and a spare that shares
rank 0's GPU would share its memory too. So the launcher gives each of its slots (the host's ranks
plus its spares) a device of its own, refuses a host that has fewer devices than slots, and a
respawned spare takes the slot, and the device, of the member that died.

Devices come from `--gpus`: `auto` (the default: what the host shows, `CUDA_VISIBLE_DEVICES` when it
is set, else one per GPU the NVIDIA driver lists; none on a host without GPUs), `none` (a CPU job), a
count N (the first N of those), or a comma list of device ids as `CUDA_VISIBLE_DEVICES` takes them.
Only an explicit list may name a device twice: sharing a GPU is an operator's decision, for gloo.

Every member sees the plan's devices (`CUDA_VISIBLE_DEVICES`, distinct ids in slot order) and is told
the index of its own among them (`DEADPOOL_DEVICE`). Without sharing that index is the member's
`LOCAL_RANK`, as under torchrun, so `cuda:LOCAL_RANK` finds the right device too.

No torch here: the launcher starts without it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deadpool.member_config import ENV
from deadpool_protocol.errors import DeadPoolError

__all__ = ["DevicePlan", "DeviceShortageError", "detect_devices", "plan_devices"]

NVIDIA_DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
"""One folder per GPU the NVIDIA driver manages."""
NVIDIA_DEVICE_FILES = Path("/dev")
"""/dev/nvidia0, /dev/nvidia1, ...: where the driver's folder is not mounted (some containers)."""


class DeviceShortageError(DeadPoolError, ValueError):
    """The host has fewer devices than members to give one each (the message says what to do)."""


@dataclass(frozen=True)
class DevicePlan:
    """The device of each slot (slot i is the i-th member the launcher starts; a respawn reuses the
    dead member's slot)."""

    devices: tuple[str, ...]

    @property
    def visible(self) -> tuple[str, ...]:
        """The distinct devices, in slot order: every member's `CUDA_VISIBLE_DEVICES`."""
        return tuple(dict.fromkeys(self.devices))

    def index_of(self, slot: int) -> int:
        return self.visible.index(self.devices[slot])

    def env_for(self, slot: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.visible), ENV.DEVICE: str(self.index_of(slot))}


def detect_devices(
    env: Mapping[str, str] | None = None,
    driver_dir: Path = NVIDIA_DRIVER_GPUS,
    device_files: Path = NVIDIA_DEVICE_FILES,
) -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` ids: that variable's entries when it is
    set (empty or -1: none), else indices 0..n-1 for the n GPUs the driver lists."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if "-1" in ids:  # CUDA hides every device from the first invalid id on
            ids = ids[: ids.index("-1")]
        return ids
    try:
        count = sum(1 for _ in driver_dir.iterdir())
    except OSError:
        try:
            count = sum(1 for p in device_files.iterdir() if re.fullmatch(r"nvidia\d+", p.name))
        except OSError:
            count = 0
    return [str(i) for i in range(count)]


def plan_devices(gpus: str, ranks: int, spares: int, detected: Sequence[str]) -> DevicePlan | None:
    """Each slot's device under `--gpus gpus`, or None for a CPU job. Raises DeviceShortageError when
    there are fewer devices than the `ranks + spares` slots, and ValueError for a spec it cannot read."""
    slots = ranks + spares
    spec = gpus.strip().lower()
    if spec == "none":
        return None
    if spec == "auto":
        if not detected:
            return None
        devices = list(detected)
    elif spec.isdigit():
        wanted = int(spec)
        if wanted == 0:
            return None
        if wanted > len(detected):
            raise DeviceShortageError(f"--gpus {wanted}: this host shows only {len(detected)} GPU(s)")
        devices = list(detected[:wanted])
    else:
        devices = [d.strip() for d in gpus.split(",")]
        if not all(devices):
            raise ValueError(f"--gpus {gpus!r}: give auto, none, a count, or a comma list of device ids")
        if len(devices) < slots:
            raise DeviceShortageError(
                f"--gpus {gpus}: {len(devices)} device(s) listed for {ranks} rank(s) + {spares} spare(s); "
                "list one per member (naming a device twice shares it, which only gloo allows)"
            )
        return DevicePlan(tuple(devices[:slots]))
    if len(set(devices)) < slots:
        raise DeviceShortageError(
            f"{len(set(devices))} GPU(s) for {ranks} rank(s) + {spares} spare(s) on this host: every member, "
            "spares included, needs a device of its own (NCCL refuses two ranks on one GPU, and a promoted "
            "spare keeps its device). Start fewer members, add --gpus none for a CPU job, or share devices "
            "explicitly with --gpus 0,0,... (gloo only)"
        )
    return DevicePlan(tuple(devices[:slots]))
