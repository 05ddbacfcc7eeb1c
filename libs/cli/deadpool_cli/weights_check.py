"""The oracle: are two runs' final states equal, tensor for tensor, bit for bit (`torch.equal`)?"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["compare_final_states"]


def _compare(a: Any, b: Any, where: str, diffs: list[str]) -> int:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            diffs.append(f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            delta = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else float("nan")
            diffs.append(f"{where}: values differ (max abs difference {delta:.3g})")
        return 1
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            diffs.append(f"{where}: keys differ ({sorted(map(str, set(a) ^ set(b)))[:5]})")
        return sum(_compare(a[k], b[k], f"{where}.{k}", diffs) for k in a if k in b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            diffs.append(f"{where}: lengths differ")
        return sum(_compare(x, y, f"{where}[{i}]", diffs) for i, (x, y) in enumerate(zip(a, b, strict=False)))
    if a != b:
        diffs.append(f"{where}: {a!r} != {b!r}")
    return 0


def compare_final_states(run_a: Path, run_b: Path) -> tuple[bool, int, list[str]]:
    """Compare every `rank*.pt` of two runs. Returns (identical, tensors compared, differences)."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy: harmless
    import torch

    files_a = sorted(p.name for p in run_a.glob("rank*.pt"))
    files_b = sorted(p.name for p in run_b.glob("rank*.pt"))
    if not files_a or files_a != files_b:
        return False, 0, [f"final state files differ: {files_a} vs {files_b}"]
    diffs: list[str] = []
    tensors = 0
    for name in files_a:
        a = torch.load(run_a / name, weights_only=True, map_location="cpu")
        b = torch.load(run_b / name, weights_only=True, map_location="cpu")
        tensors += _compare(a, b, name, diffs)
    return not diffs, tensors, diffs
