"""A restore from the stores is bounded: a copy larger than the member's model is refused before
anything is allocated for it, a copy the host cannot allocate is refused rather than crashing the
member, and a store that trickles is abandoned at the fetch's deadline. Each time the next store is
tried, and the state restored from it is the original, bit for bit. A warm spare's restore lands in
the buffer it faulted in beforehand, the next store's copy too when one fails midway.

Over real loopback sockets: the honest store is the store's own data-plane server, the hostile one a
small TCP server that speaks the data-plane frames.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import Any

import msgpack
import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout, TensorSpec, aligned_bytes
from deadpool.spare_landing import SpareLanding
from deadpool.store_client import FetchDeadline, StoreConnection, UploadKey
from deadpool.store_restore import SnapshotWanted, fetch_from_stores
from deadpool.training_state import SnapshotMeta, load_module, snapshot_bytes_max, snapshot_now
from deadpool_protocol import StoreAddress
from deadpool_protocol.dataplane import (
    CHUNK_BYTES_MAX,
    FRAME_LENGTH,
    FetchReply,
    chunk_checksum,
    chunk_count,
    chunk_spans,
    encode_frame,
)
from deadpool_runtime.logs import get_logger
from deadpool_store.dataplane_server import DataPlaneServer
from deadpool_store.memory import SnapshotMemory, StoredSnapshot

JOB, RANK, STEP, GENERATION, MEMBER = "bounded-restore", 0, 3, 2, "member-1"
CHUNK_BYTES = 64 * 1024
"""A snapshot of `make_model` (3 MiB) in about 50 chunks."""
DEADLINE = FetchDeadline(base_s=2.0)
LANDING_WAIT_S = 30.0
"""Short, so the trickle tests take seconds; the bound, not its size, is what they check."""
MARGIN_S = 2.0
"""Past the deadline: the abandoned fetch's close and the honest store's fetch."""
TRICKLE_PACE_S = 1.0
TRICKLE_FOR_S = 15.0
"""How long the hostile store trickles before it gives up (a fetch without a deadline takes this long)."""
HOLD_S = 15.0
"""How long the hostile store holds a connection open after its reply."""


def make_model() -> nn.Module:
    """About 1 MiB of parameters and buffers: a snapshot of it may hold 329 MiB (`snapshot_bytes_max`)."""
    return nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.Linear(1024, 4))


def model_and_snapshot() -> tuple[nn.Module, FlatBuffer, SnapshotMeta]:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEP):
        model(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    buffer, meta = snapshot_now(model, optimizer, STEP)
    return model, buffer, meta


def fresh_model() -> nn.Module:
    torch.manual_seed(1)  # built differently: every tensor must come from the snapshot
    return make_model()


def meta_with_layout(meta: SnapshotMeta, layout_fields: dict[str, object]) -> bytes:
    """`meta` encoded with another layout (whatever it claims: this is what a hostile store sends)."""
    fields = msgpack.unpackb(meta.encode(), raw=False)
    fields["layout"] = msgpack.packb(layout_fields, use_bin_type=True)
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


def fetch_reply(meta_bytes: bytes, total_bytes: int, chunk_bytes: int, checksums: list[int] | None = None) -> bytes:
    """A FetchReply frame for a snapshot of `total_bytes` (zero checksums unless given)."""
    sums = checksums if checksums is not None else [0] * chunk_count(total_bytes, chunk_bytes)
    return encode_frame(FetchReply(True, "", GENERATION, MEMBER, total_bytes, chunk_bytes, sums, meta_bytes))


def honest_reply(buffer: FlatBuffer, meta: SnapshotMeta) -> bytes:
    """What an honest store sends for this snapshot: its FetchReply and its bytes."""
    data = bytes(buffer.bytes_view())
    sums = [chunk_checksum(data[o : o + n]) for o, n in chunk_spans(len(data), CHUNK_BYTES)]
    return fetch_reply(meta.encode(), len(data), CHUNK_BYTES, sums) + data


def larger_total(meta: SnapshotMeta) -> tuple[bytes, int]:
    """The layout's own entries, and a total of 512 GiB beyond them."""
    total = 1 << 39
    return meta_with_layout(meta, {**meta.layout.to_fields(), "total_bytes": total}), total


def huge_tree_tensor(meta: SnapshotMeta) -> tuple[bytes, int]:
    """A consistent layout with one more state-tree tensor, of 512 GiB."""
    spec = TensorSpec(f"state.{meta.tree_count()}", "float64", (1 << 36,), meta.layout.total_bytes, 1 << 39)
    layout = SnapshotLayout((*meta.layout.specs, spec), meta.layout.total_bytes + aligned_bytes(spec.nbytes))
    return meta_with_layout(meta, layout.to_fields()), layout.total_bytes


def huge_optimizer_tensor(meta: SnapshotMeta) -> tuple[bytes, int]:
    """A consistent layout whose first optimizer tensor holds 2**30 elements (all parameters: 269,316)."""
    specs, offset = [], 0
    for spec in meta.layout.specs:
        if spec.name == "optim.0.exp_avg":
            spec = replace(spec, shape=(1 << 30,), nbytes=4 << 30)
        specs.append(replace(spec, offset=offset))
        offset += aligned_bytes(spec.nbytes)
    return meta_with_layout(meta, SnapshotLayout(tuple(specs), offset).to_fields()), offset


class HostileStore:
    """A TCP server that answers a Fetch with `payload`: its first `at_once` bytes at once, then the
    rest a byte per `pace_s`; then it holds the connection open. Every phase is bounded."""

    def __init__(self, payload: bytes, at_once: int, pace_s: float = TRICKLE_PACE_S) -> None:
        self.payload, self.at_once, self.pace_s = payload, at_once, pace_s
        self.served = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.served += 1
        try:
            (length,) = FRAME_LENGTH.unpack(await reader.readexactly(FRAME_LENGTH.size))
            await reader.readexactly(length)  # the Fetch
            writer.write(self.payload[: self.at_once])
            await writer.drain()
            until = time.monotonic() + TRICKLE_FOR_S
            for i in range(self.at_once, len(self.payload)):
                if time.monotonic() > until:
                    return
                await asyncio.sleep(self.pace_s)  # the hostile behaviour itself, not a synchronisation
                writer.write(self.payload[i : i + 1])
                await writer.drain()
            await asyncio.wait_for(reader.read(), HOLD_S)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            return  # the member closed the connection
        finally:
            writer.close()

    def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> tuple[asyncio.Server, StoreAddress]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return server, StoreAddress("hostile", "127.0.0.1", int(server.sockets[0].getsockname()[1]))

    async def stop(self, server: asyncio.Server) -> None:
        server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def no_op(_snap: StoredSnapshot) -> None:
    return None


StartHostile = Callable[[HostileStore], Awaitable[StoreAddress]]


@pytest.fixture
async def honest() -> AsyncIterator[tuple[StoreAddress, nn.Module, FlatBuffer, SnapshotMeta]]:
    """A real store's data-plane server holding the snapshot, and the model it was taken of."""
    server = DataPlaneServer(SnapshotMemory(64 << 20), no_op, get_logger(test="bounded-restore"))
    address = StoreAddress("honest", "127.0.0.1", await server.start("127.0.0.1", 0))
    model, buffer, meta = model_and_snapshot()
    uploader = StoreConnection(address)
    key = UploadKey(JOB, GENERATION, RANK, MEMBER, STEP)
    await asyncio.to_thread(uploader.upload, key, buffer.bytes_view(), CHUNK_BYTES, meta.encode(), lambda: False)
    uploader.close()
    yield address, model, buffer, meta
    await server.stop()


@pytest.fixture
async def start_hostile() -> AsyncIterator[StartHostile]:
    started: list[tuple[HostileStore, asyncio.Server]] = []

    async def start(store: HostileStore) -> StoreAddress:
        server, address = await store.start()
        started.append((store, server))
        return address

    yield start
    for store, server in started:
        await store.stop(server)


def restore(stores: list[StoreAddress]) -> tuple[FlatBuffer, SnapshotMeta, str]:
    """A spare's restore of (RANK, STEP) from `stores`, in that order, into a model of its own."""
    wanted = SnapshotWanted(JOB, RANK, STEP, GENERATION)
    return fetch_from_stores(wanted, stores, fresh_model(), get_logger(test="bounded-restore"), deadline=DEADLINE)


def assert_restored_exactly(
    got: tuple[FlatBuffer, SnapshotMeta, str], original: nn.Module, buffer: FlatBuffer, meta: SnapshotMeta
) -> None:
    restored, restored_meta, store = got
    assert store == "honest"
    assert restored_meta.layout == meta.layout and restored_meta.step == STEP
    assert all(torch.equal(a, b) for a, b in zip(restored.views, buffer.views, strict=True))
    model = fresh_model()
    load_module(model, [restored])
    for a, b in zip(model.state_dict().values(), original.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def refusals(logs: list[MutableMapping[str, Any]]) -> list[str]:
    return [str(e["reason"]) for e in logs if e["event"] == "store's copy refused; trying the next"]


@pytest.mark.parametrize(
    ("claim", "why"),
    [
        (larger_total, "its entries end at"),
        (huge_tree_tensor, "larger than this model's can be"),
        (huge_optimizer_tensor, "elements, the model's parameters"),
    ],
    ids=["a-total-beyond-its-entries", "a-tree-tensor-of-512-GiB", "an-optimizer-tensor-larger-than-the-model"],
)
async def test_a_copy_larger_than_the_model_is_refused_before_allocating_and_the_next_store_restores(
    honest: tuple[StoreAddress, nn.Module, FlatBuffer, SnapshotMeta],
    start_hostile: StartHostile,
    claim: Callable[[SnapshotMeta], tuple[bytes, int]],
    why: str,
) -> None:
    address, original, buffer, meta = honest
    meta_bytes, total = claim(meta)
    hostile = await start_hostile(HostileStore(fetch_reply(meta_bytes, total, CHUNK_BYTES_MAX), at_once=1 << 30))
    with capture_logs() as logs:
        got = await asyncio.to_thread(restore, [hostile, address])
    (reason,) = refusals(logs)
    # The fit check's reason, and the fit check runs before the buffer is allocated. Without it, the
    # 512 GiB claims raise out of the allocator, and the 4 GiB one is allocated and waits for its bytes.
    assert "does not fit this model" in reason and why in reason, reason
    assert_restored_exactly(got, original, buffer, meta)


async def test_a_copy_the_host_cannot_allocate_is_refused_and_the_next_store_restores(
    honest: tuple[StoreAddress, nn.Module, FlatBuffer, SnapshotMeta], start_hostile: StartHostile
) -> None:
    address, original, buffer, meta = honest
    extra = 256 << 20  # within what a snapshot of this model may hold, beyond what this process may map
    spec = TensorSpec(f"state.{meta.tree_count()}", "uint8", (extra,), meta.layout.total_bytes, extra)
    layout = SnapshotLayout((*meta.layout.specs, spec), meta.layout.total_bytes + extra)
    reply = fetch_reply(meta_with_layout(meta, layout.to_fields()), layout.total_bytes, CHUNK_BYTES_MAX)
    hostile = await start_hostile(HostileStore(reply, at_once=1 << 30))

    def restore_with_little_memory() -> tuple[FlatBuffer, SnapshotMeta, str]:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + (24 << 20), hard))
        try:
            return restore([hostile, address])
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    with capture_logs() as logs:
        got = await asyncio.to_thread(restore_with_little_memory)
    (reason,) = refusals(logs)
    assert "no memory for the store's snapshot" in reason, reason
    assert_restored_exactly(got, original, buffer, meta)


def mapped_bytes() -> int:
    """This process's address space now (what RLIMIT_AS bounds)."""
    with open("/proc/self/status") as status:
        (kib,) = (int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    return kib * 1024


@pytest.mark.parametrize("phase", ["header", "chunks"])
async def test_a_trickling_store_is_abandoned_at_the_fetch_deadline_and_the_next_store_restores(
    honest: tuple[StoreAddress, nn.Module, FlatBuffer, SnapshotMeta], start_hostile: StartHostile, phase: str
) -> None:
    address, original, buffer, meta = honest
    payload = honest_reply(buffer, meta)
    header = len(payload) - meta.layout.total_bytes
    at_once = 0 if phase == "header" else header + CHUNK_BYTES  # a first chunk arrives whole
    hostile = HostileStore(payload, at_once)
    hostile_address = await start_hostile(hostile)
    started = time.monotonic()
    with capture_logs() as logs:
        got = await asyncio.to_thread(restore, [hostile_address, address])
    elapsed = time.monotonic() - started
    assert hostile.served == 1
    (reason,) = refusals(logs)
    assert "deadline" in reason, reason
    assert elapsed < DEADLINE.seconds(meta.layout.total_bytes) + MARGIN_S, elapsed  # a bound, not a goal
    assert_restored_exactly(got, original, buffer, meta)


async def test_a_warm_spare_lands_in_its_buffer_and_after_a_copy_failing_midway_the_next_lands_there_too(
    honest: tuple[StoreAddress, nn.Module, FlatBuffer, SnapshotMeta], start_hostile: StartHostile
) -> None:
    address, original, buffer, meta = honest
    payload = bytearray(honest_reply(buffer, meta))
    payload[-1] ^= 0xFF  # the last chunk fails its checksum: the landing already holds the rest
    hostile = await start_hostile(HostileStore(bytes(payload), at_once=1 << 30))
    landing = SpareLanding(snapshot_bytes_max(fresh_model()), pin=False, log=get_logger(test="bounded-restore"))
    landing.want(meta.layout.total_bytes)
    landing.start()
    # A spare's restore comes after its landing is warm; without this wait a busy machine let the
    # restore ask before the faulting thread had made the buffer (CI: nothing was taken).
    assert landing.wait_faulted(meta.layout.total_bytes, LANDING_WAIT_S), "the landing was not faulted in"
    taken: list[torch.Tensor] = []

    def take(nbytes: int) -> torch.Tensor | None:
        got = landing.take(nbytes)
        taken.extend([got] if got is not None else [])
        return got

    def warm_restore() -> tuple[FlatBuffer, SnapshotMeta, str]:
        wanted = SnapshotWanted(JOB, RANK, STEP, GENERATION)
        log = get_logger(test="bounded-restore")
        return fetch_from_stores(wanted, [hostile, address], fresh_model(), log, deadline=DEADLINE, landing=take)

    with capture_logs() as logs:
        got = await asyncio.to_thread(warm_restore)
    (reason,) = refusals(logs)
    assert "fails its checksum" in reason, reason
    (landed,) = taken  # taken once, by the first copy, and the second landed in it as well
    assert got[0].data.data_ptr() == landed.data_ptr() and got[0].data.numel() == meta.layout.total_bytes
    assert_restored_exactly(got, original, buffer, meta)
    assert landing.take(meta.layout.total_bytes) is None, "a landing is taken once"
