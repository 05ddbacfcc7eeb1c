"""The state tree: nested user and optimizer state comes back equal, types included; what it cannot
hold exactly is refused with the path to it, and malformed bytes are refused, not half-decoded."""

from __future__ import annotations

import msgpack
import pytest
import torch
from torch import nn

from deadpool.snapshot_layout import FlatBuffer
from deadpool.state_tree import TreeError, decode_tree, encode_tree
from deadpool.training_state import SnapshotMeta, load_optimizer, load_user_state, snapshot_now
from deadpool_cli.weights_check import _compare


def test_nested_values_come_back_equal_with_tuples_int_keys_and_tensors() -> None:
    value = {"a": [1, 2.5, None, True, "x", b"\x00"], 3: (4, (5, torch.arange(3))), "t": torch.ones(2, 2)}
    data, tensors = encode_tree(value)
    assert len(tensors) == 2
    back = decode_tree(data, lambda i: tensors[i].clone(), len(tensors))
    assert back["a"] == value["a"] and isinstance(back[3], tuple) and isinstance(back[3][1], tuple)
    assert torch.equal(back[3][1][1], torch.arange(3)) and torch.equal(back["t"], torch.ones(2, 2))


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"f": lambda: 0}, "state['f']"),
        ({"deep": [{"x": object()}]}, "state['deep'][0]['x']"),
        ({(1, 2): 0}, "state: a key of type tuple"),
        ({"big": 1 << 70}, "state['big']"),
        ({"sparse": torch.eye(2).to_sparse()}, "state['sparse']"),
    ],
)
def test_a_value_that_cannot_be_held_exactly_is_refused_with_its_path(value: object, where: str) -> None:
    with pytest.raises(TreeError, match=where.replace("[", r"\[").replace("(", r"\(")):
        encode_tree(value)


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never used in msgpack
        msgpack.packb(msgpack.ExtType(2, msgpack.packb([5, "cpu"]))),  # tensor 5 of 1
        msgpack.packb(msgpack.ExtType(2, msgpack.packb([0, "tpu"]))),
        msgpack.packb(msgpack.ExtType(9, b"")),
    ],
)
def test_malformed_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed"):
        decode_tree(data, lambda i: torch.zeros(1), 1)


def test_every_kind_of_optimizer_state_is_restored_exactly() -> None:
    """SparseAdam's int step, LBFGS's history lists and float counters, a tensor learning rate and a
    scheduler over it, SGD's momentum: a replica built differently continues exactly like the original."""

    def build(seed: int) -> tuple[nn.ModuleDict, list[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(seed)
        model = nn.ModuleDict({"e": nn.Embedding(8, 4, sparse=True), "l": nn.Linear(4, 1), "s": nn.Linear(4, 1)})
        sparse = torch.optim.SparseAdam(model["e"].parameters(), lr=0.01)
        lbfgs = torch.optim.LBFGS(model["l"].parameters(), lr=0.5, max_iter=2, history_size=3)
        adam = torch.optim.Adam(model["l"].parameters(), lr=torch.tensor(0.01), foreach=False)
        sgd = torch.optim.SGD(model["s"].parameters(), lr=0.05, momentum=0.9, nesterov=True)
        return model, [sparse, lbfgs, adam, sgd], torch.optim.lr_scheduler.LambdaLR(adam, lambda s: 0.5**s)

    def train(model: nn.ModuleDict, optimizers: list[torch.optim.Optimizer], sched: object, steps: int) -> None:
        sparse, lbfgs, adam, sgd = optimizers
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            ids, x = torch.randint(8, (3,), generator=g), torch.randn(3, 4, generator=g)

            def closure(x: torch.Tensor = x, ids: torch.Tensor = ids) -> float:
                lbfgs.zero_grad()
                loss = (model["l"](x + model["e"](ids)) + model["s"](x)).square().mean()
                loss.backward()
                return float(loss)

            closure()
            sparse.step()
            adam.step()
            sgd.step()
            lbfgs.step(closure)
            sched.step()  # type: ignore[attr-defined]
            model.zero_grad(set_to_none=True)  # as a restore leaves them

    original, optimizers, sched = build(0)
    train(original, optimizers, sched, 4)
    shots = [
        snapshot_now(original, opt, 4, user={"sched": sched} if i == 2 else None) for i, opt in enumerate(optimizers)
    ]
    train(original, optimizers, sched, 3)

    replica, replica_optimizers, replica_sched = build(1)
    for i, ((buffer, meta), opt) in enumerate(zip(shots, replica_optimizers, strict=True)):
        tree = meta.decode_tree(buffer)
        load_optimizer(replica, opt, [buffer], tree)
        if i == 2:
            load_user_state({"sched": replica_sched}, tree)
    with torch.no_grad():
        for p, q in zip(replica.parameters(), snapshot_params(shots), strict=True):
            p.copy_(q)
    train(replica, replica_optimizers, replica_sched, 3)
    for p, q in zip(original.parameters(), replica.parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(optimizers, replica_optimizers, strict=True):
        differences: list[str] = []
        assert _compare(a.state_dict(), b.state_dict(), type(a).__name__, differences) > 0
        assert differences == []
    assert replica_sched.state_dict() == sched.state_dict()


def snapshot_params(shots: list[tuple[FlatBuffer, SnapshotMeta]]) -> list[torch.Tensor]:
    return [shots[0][0].by_name[f"param.{i}"] for i in range(5)]
