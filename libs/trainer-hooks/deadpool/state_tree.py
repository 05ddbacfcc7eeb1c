"""State that is not a flat list of tensors, carried in a snapshot: nested dicts, lists and tuples of
numbers, strings and tensors (a scheduler's or a data loader's `state_dict()`, LBFGS's history, a
tensor learning rate).

`encode_tree` splits such a value into msgpack bytes, where each tensor is a reference, and the list
of tensors referred to, which go into the snapshot's buffer like any other tensor. `decode_tree`
puts them back together. Tuples stay tuples and integer keys stay integers, so what comes back
compares equal to what went in. Anything else (an object, a function, a NumPy scalar) is refused
with the path to it: a value we cannot restore exactly must not be dropped silently.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import msgpack
import torch

from deadpool_protocol.errors import DeadPoolError

__all__ = ["MAX_TREE_TENSORS", "TreeError", "decode_tree", "encode_tree"]

_TUPLE = 1
_TENSOR = 2
MAX_TREE_TENSORS = 1 << 20
"""A decoded tree may refer to at most this many tensors (it comes off the wire)."""
_DEVICES = ("cpu", "cuda")
"""Where a tree's tensor is put back: on the device type it came from (a CUDA tensor on this
process's current device; the CPU where no GPU is left)."""
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1


class TreeError(DeadPoolError, TypeError):
    """A value cannot be captured exactly; the text names where it is and what it is."""


def encode_tree(value: Any, path: str = "state") -> tuple[bytes, list[torch.Tensor]]:
    """`value` as msgpack bytes with tensor references, and the tensors referred to, in order.

    Runs on the training thread at every capture, so the walk keeps the keys it is under on a stack
    and formats a path only for the error it raises."""
    tensors: list[torch.Tensor] = []
    keys: list[Any] = []

    def refuse(why: str) -> TreeError:
        where = path + "".join(f"[{k!r}]" for k in keys)
        return TreeError(f"{where}: {why}")

    def walk(v: Any) -> Any:
        if v is None or isinstance(v, bool | str | bytes | float):
            return v
        if isinstance(v, int):
            if not _INT_MIN <= v <= _INT_MAX:
                raise refuse(f"the integer {v} does not fit 64 bits")
            return int(v)
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                raise refuse(f"a {v.layout} tensor; a snapshot holds dense tensors only")
            device = v.device.type
            if device not in _DEVICES:
                raise refuse(f"a tensor on {v.device}, which a snapshot cannot restore")
            tensors.append(v)  # copied under no_grad at capture: no detach needed
            return _reference(len(tensors) - 1, device)
        if isinstance(v, list | tuple):
            items = []
            for i, item in enumerate(v):
                keys.append(i)
                items.append(walk(item))
                keys.pop()
            return items if isinstance(v, list) else msgpack.ExtType(_TUPLE, _pack(items))
        if isinstance(v, dict):
            out = {}
            for key, item in v.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise refuse(f"a key of type {type(key).__name__} ({key!r}); keys must be str or int")
                keys.append(key)
                out[key] = walk(item)
                keys.pop()
            return out
        raise refuse(
            f"a {type(v).__module__}.{type(v).__qualname__}, which a snapshot cannot hold "
            "(only None, bool, int, float, str, bytes, tensors, and lists, tuples and dicts of them)"
        )

    return _pack(walk(value)), tensors


def decode_tree(data: bytes, tensor: Callable[[int], torch.Tensor], tensor_count: int) -> Any:
    """The value `encode_tree` encoded; `tensor(i)` gives the i-th of its `tensor_count` tensors.
    Raises ValueError if the bytes are malformed or refer to a tensor that is not there."""
    if not 0 <= tensor_count <= MAX_TREE_TENSORS:
        raise ValueError(f"a state tree of {tensor_count} tensors")

    def ext(code: int, payload: bytes) -> Any:
        if code == _TUPLE:
            items = _unpack(payload)
            if not isinstance(items, list):
                raise ValueError("malformed state tree: a tuple that is not a sequence")
            return tuple(items)
        if code == _TENSOR:
            ref = msgpack.unpackb(payload, raw=False)
            if not isinstance(ref, list) or len(ref) != 2 or ref[1] not in _DEVICES:
                raise ValueError(f"malformed state tree: tensor reference {ref!r}")
            index, device = ref
            if not isinstance(index, int) or not 0 <= index < tensor_count:
                raise ValueError(f"malformed state tree: tensor reference {index!r} of {tensor_count}")
            value = tensor(index)
            return value.to(device) if device == "cuda" and torch.cuda.is_available() else value
        raise ValueError(f"malformed state tree: unknown extension {code}")

    def _unpack(payload: bytes) -> Any:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False, ext_hook=ext)

    try:
        return _unpack(data)
    except (TypeError, ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed state tree: {exc}") from None


@functools.lru_cache(maxsize=1 << 16)
def _reference(index: int, device: str) -> msgpack.ExtType:
    """The reference to tensor `index` (the same ones recur at every capture)."""
    return msgpack.ExtType(_TENSOR, msgpack.packb([index, device]))


def _pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data
