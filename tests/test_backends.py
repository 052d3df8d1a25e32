"""The torch path and the CPU backend at the edges the conformance suite does not reach.

Index buffers for devices (checked on ``meta``, which has no data but real buffers), the
torch backend's knobs, units larger than its pass size, copies with more runs than it
copies one by one, and the CPU backend with and without its compiled kernels. Found by
mutation testing (ci/mutation.py).
"""

from __future__ import annotations

import re
import threading

import kvhost_torch.backend
import numpy as np
import pytest
import torch
from kvhost_torch.backend import IndexBuffers, TorchBackend, current_stream

import kvhost
from kvhost.backend import OptionalKernels, next_power_of_two
from kvhost.testing import CopyCase, ReceiveCase, fill_random, make_cache, raw

SIZES = dict(K=2, B=8, N=8, H=2, C=4)
META = torch.device("meta")


# --- index buffers on a device ------------------------------------------------------------


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 5, 64, 65, 1 << 40)] == [1, 1, 2, 4, 8, 64, 128, 1 << 40]


def test_host_ids_are_used_in_place():
    ids = np.array([3, 1, 2], dtype=np.int64)
    index = IndexBuffers()(ids, torch.device("cpu"))
    assert index.data_ptr() == ids.ctypes.data and index.tolist() == [3, 1, 2]


def test_current_stream_is_torch_s_own_or_none():
    """The host's stream is ``torch.cpu``'s (torch gives the host a stream); meta has none."""
    assert isinstance(current_stream(torch.device("cpu")), torch.cpu.Stream)
    assert current_stream(META) is None


def _buffer(buffers: IndexBuffers) -> torch.Tensor:
    """The one buffer ``buffers`` holds for this thread (one device, one stream here)."""
    (buffer,) = buffers._local.buffers.values()
    return buffer


def test_device_ids_go_through_one_growing_buffer_per_thread():
    buffers = IndexBuffers()
    index = buffers(np.arange(5), META)
    assert (index.device, index.shape, index.dtype) == (META, (5,), torch.int64)
    buffer = _buffer(buffers)
    assert buffer.numel() == 1024 and buffer.device == META  # at least 1024
    assert buffers(np.arange(1024), META).shape == (1024,) and _buffer(buffers) is buffer  # fits: reused
    assert buffers(np.arange(1025), META).shape == (1025,)
    assert _buffer(buffers).numel() == 2048  # grown to the next power of two
    assert IndexBuffers()(np.arange(3000), META).shape == (3000,)
    fresh = IndexBuffers()
    fresh(np.arange(3000), META)
    assert _buffer(fresh).numel() == 4096
    exact = IndexBuffers()
    exact(np.arange(2048), META)
    assert _buffer(exact).numel() == 2048  # a power of two is room enough for itself
    elsewhere: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: (buffers(np.arange(2), META), elsewhere.append(_buffer(buffers))))
    thread.start()
    thread.join()
    assert elsewhere[0] is not _buffer(buffers)  # each thread its own


# --- the torch backend ---------------------------------------------------------------------


def test_torch_backend_settings():
    default = TorchBackend()
    assert (default.host_chunk_bytes, default.device_chunk_bytes, default.max_run_copies) == (1 << 20, None, 64)
    assert (default.host_thread_bytes, default.host_split_bytes) == (1 << 20, 8 << 20)
    tuned = TorchBackend(
        host_chunk_bytes=4096, device_chunk_bytes=8192, max_run_copies=2, host_thread_bytes=0, host_split_bytes=5
    )
    assert (tuned.host_chunk_bytes, tuned.device_chunk_bytes, tuned.max_run_copies) == (4096, 8192, 2)
    assert (tuned.host_thread_bytes, tuned.host_split_bytes) == (0, 5)
    assert TorchBackend.priority == -100  # the fallback plugins rank against (docs/plugins.md, README)


def test_a_non_blocking_copy_on_a_device_without_events_is_done_on_return():
    # meta has no events: the copy is then finished before copy_blocks returns.
    src = {"l": make_cache("KBNHC", "KBNHC", SIZES, device=META)}
    dst = {"l": make_cache("KBNHC", "KBNHC", SIZES, device=META)}
    result = kvhost.copy_blocks(src, dst, [1, 2], [3, 4], axes="KBNHC", non_blocking=True)
    assert result.backend == "torch" and result.done()
    assert result.wait() is result


@pytest.mark.parametrize("host_chunk_bytes", [None, 4096])
def test_units_larger_than_a_pass_are_rewritten_one_at_a_time(host_chunk_bytes):
    # A sender block of 8 local blocks: a 1 MiB unit per K, 2 MiB in all: more than a pass.
    sizes = dict(K=2, B=18, N=64, H=8, C=128)
    caches = {"l": make_cache("KBNHC", "KBNHC", sizes)}
    case = ReceiveCase(caches, "KBNHC", seed=8)
    ids = [9, 1, 2, 3, 17, 5, 6, 7, 0, 10, 11, 12, 13, 14, 15, 16]
    case.send("r", ids, "HNC", 512)
    backend = TorchBackend(host_chunk_bytes=host_chunk_bytes)
    kvhost.receive(caches, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=512, backend=backend)
    case.check()


def test_copies_with_more_runs_than_copied_one_by_one_are_gathered():
    src = {"l": fill_random(make_cache("KBNHC", "KBHNC", SIZES), 1)}
    dst = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 2)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    src_ids, dst_ids = [0, 1, 5, 3], [6, 7, 2, 0]  # three runs, more than max_run_copies
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=TorchBackend(max_run_copies=2))
    case.check(src_ids, dst_ids)


def counted(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    """Count calls of a torch.Tensor method (the passes a backend makes)."""
    return _calls_counted(monkeypatch, torch.Tensor, method)


@pytest.mark.parametrize(
    ("device", "host_chunk_bytes", "passes"),
    [("cpu", 256, 5), ("cpu", 512, 3), ("cpu", None, 1), ("meta", 256, 1)],
)
def test_a_receive_scatters_once_per_pass_of_chunk_bytes(monkeypatch, device, host_chunk_bytes, passes):
    # A unit is one 128-byte region in each of 2 outer indices (K): 256 bytes per pass
    # takes one unit, 512 two; a device takes the group in one pass (device_chunk_bytes None).
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES, device=device)}
    case = ReceiveCase(caches, "KBNHC", seed=9) if device == "cpu" else None
    ids = [1, 2, 3, 4, 5]
    if case is not None:
        case.send("r", ids, "HNC", 8)
    backend = TorchBackend(host_chunk_bytes=host_chunk_bytes, host_thread_bytes=0)  # torch's ops on the host too
    scatters = counted(monkeypatch, "index_copy_")
    kvhost.receive(caches, {"r": ids}, axes="KBNHC", remote_order="HNC", backend=backend)
    assert len(scatters) == passes
    if case is not None:
        case.check()


@pytest.mark.parametrize("host_thread_bytes", [None, 513, 512, 257, 256])
@pytest.mark.parametrize(
    ("remote_block_size", "ids", "unit_bytes"), [(4, [1, 2, 3, 4, 5], 256), (16, [2, 3, 6, 7], 512)]
)
def test_a_host_receive_of_small_units_goes_unit_by_unit_on_the_calling_thread(
    monkeypatch, host_thread_bytes, remote_block_size, ids, unit_bytes
):
    """Units of 256 bytes (r = 2: one block, 2 x 128) and 512 (g = 2: two blocks): numpy
    below ``host_thread_bytes``, torch's ops (one pass) at it; the wire bytes land either way.
    Numpy's way makes no index tensor (a torch call, 10-35 us cold)."""
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=4)
    case.send("r", ids, "HNC", remote_block_size)
    made = counted(monkeypatch, "index_copy_")
    backend = TorchBackend(host_thread_bytes=host_thread_bytes)
    index_tensors = _calls_counted(monkeypatch, backend, "index_buffers")
    kvhost.receive(
        caches, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=remote_block_size, backend=backend
    )
    monkeypatch.undo()
    assert len(made) == len(index_tensors) == int(unit_bytes >= backend.host_thread_bytes)
    case.check()


@pytest.mark.parametrize("host_thread_bytes", [None, 0])  # numpy unit by unit; torch's ops
@pytest.mark.parametrize(
    ("axes", "channels", "dtype", "remote_order", "remote_block_size", "moved_as"),
    [
        ("KBNHC", 4, torch.bfloat16, "HNC", 4, torch.int64),  # 4 x 2 bytes: one 8-byte element
        ("KBNHC", 4, torch.float32, "HNC", 4, torch.int64),  # 4 x 4 bytes: two
        ("KBNHC", 3, torch.bfloat16, "HNC", 4, torch.int16),  # 6 bytes: not a multiple of 8
        ("KBNHC", 8, torch.float8_e4m3fn, "HNC", 4, torch.int64),  # 8 x 1 byte
        ("KBNHC", 4, torch.bfloat16, "NCH", 4, torch.int16),  # C not innermost on the wire
        ("KBHCN", 4, torch.bfloat16, "HCN", 2, torch.int16),  # tokens innermost: runs of 2 on the wire
        ("KBHCN", 4, torch.bfloat16, "HCN", 4, torch.int64),  # runs of 4 tokens, 8 bytes
    ],
)
def test_a_host_receive_moves_8_byte_integers_where_the_innermost_dim_allows(
    monkeypatch, host_thread_bytes, axes, channels, dtype, remote_order, remote_block_size, moved_as
):
    """Where the wire's innermost dim stays innermost locally and a run of it is a multiple
    of 8 bytes, the rearrangement moves 8-byte elements; otherwise the raw item. The wire
    bytes land either way (local blocks of 8 tokens, r = 2 or 4)."""
    import kvhost_torch.backend as torch_backend

    sizes = {a: dict(SIZES, C=channels)[a] for a in axes}
    caches = {"l": make_cache(axes, axes, sizes, dtype=dtype)}
    case = ReceiveCase(caches, axes, seed=6)
    ids = [1, 2, 3, 4, 5]
    case.send("r", ids, remote_order, remote_block_size)
    seen: list[torch.dtype] = []
    original_units, original_copy = torch_backend._receive_units, torch.Tensor.index_copy_

    def units(blocks, *args):  # type: ignore[no-untyped-def]
        seen.append(torch.from_numpy(blocks[:0]).dtype)
        return original_units(blocks, *args)

    def index_copy(self, *args):  # type: ignore[no-untyped-def]
        seen.append(self.dtype)
        return original_copy(self, *args)

    monkeypatch.setattr(torch_backend, "_receive_units", units)
    monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy)
    backend = TorchBackend(host_thread_bytes=host_thread_bytes)
    kvhost.receive(
        caches, {"r": ids}, axes=axes, remote_order=remote_order, remote_block_size=remote_block_size, backend=backend
    )
    monkeypatch.undo()
    assert seen == [moved_as]
    case.check()


def test_up_to_max_run_copies_runs_a_copy_is_one_copy_per_run(monkeypatch):
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)}
    dst = {"l": torch.zeros_like(src["l"])}
    backend = TorchBackend(max_run_copies=2)
    gathers = counted(monkeypatch, "index_copy_")
    kvhost.copy_blocks(src, dst, [0, 1, 5], [2, 3, 6], axes="KBNHC", backend=backend)  # two runs
    assert gathers == []
    kvhost.copy_blocks(src, dst, [0, 1, 5, 3], [2, 3, 6, 0], axes="KBNHC", backend=backend)  # three runs
    assert gathers == [1]
    assert torch.equal(raw(dst["l"])[:, [2, 3, 6, 0]], raw(src["l"])[:, [0, 1, 5, 3]])


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "op"),
    [
        ([5, 2, 7], [0, 1, 2], "index_select"),  # into a destination run: a gather, torch's at any size
        ([0, 1, 2], [6, 3, 5], "index_copy_"),  # from a source run: a scatter
        ([0, 1, 2, 5], [3, 4, 5, 7], "copy_"),  # runs alike on both sides
    ],
)
@pytest.mark.parametrize(("host_thread_bytes", "below"), [(None, True), (769, True), (768, False), (0, False)])
def test_host_calls_under_host_thread_bytes_run_on_the_calling_thread(
    monkeypatch, src_ids, dst_ids, op, host_thread_bytes, below
):
    """Blocks of 256 bytes (2 x 8 x 2 x 4 bf16), calls of up to 3 blocks: scatters and copies
    through numpy below the bound, torch's op at it; these gathers through torch's op always,
    one call per index of K at any size: HND into NHD, the slices under K are not dense."""
    bound = 1 << 20 if host_thread_bytes is None else host_thread_bytes
    assert below is (bound > 3 * 256)
    # torch's calls: a gather 2 (per K); a scatter of 3 blocks 0 or 1; copy_ of two runs (3
    # blocks, 1 block) one for each run at the bound
    calls = {"index_select": 2, "index_copy_": 0 if below else 1}.get(op)
    if calls is None:
        calls = sum(n * 256 >= bound for n in (3, 1))
    src = {"l": fill_random(make_cache("KBNHC", "KBHNC", SIZES), 1)}
    dst = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 2)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    torch_calls = _gathers_counted(monkeypatch) if op == "index_select" else counted(monkeypatch, op)
    backend = TorchBackend(host_thread_bytes=host_thread_bytes)
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=backend)
    monkeypatch.undo()
    assert len(torch_calls) == calls
    case.check(src_ids, dst_ids)


def test_run_ids_numpy_views_at_once_tensors_at_the_first_torch_call():
    from kvhost_torch.backend import _RunIds

    ids = np.array([9, 4, 7, 2, 8], dtype=np.int64)
    runs = [(0, 10, 2), (2, 30, 3)]  # (position in ids, first id of the other side, count)
    run_ids = _RunIds(ids, torch.device("cpu"), runs)
    assert [run_ids.array(n).tolist() for n in (0, 1)] == [[9, 4], [7, 2, 8]]
    assert np.shares_memory(run_ids.array(1), ids)
    assert run_ids._tensors is None  # numpy's calls make no tensor
    made = [run_ids.tensor(n) for n in (0, 1)]
    assert [index.tolist() for index in made] == [[9, 4], [7, 2, 8]]
    assert [index.data_ptr() for index in made] == [ids.ctypes.data, ids.ctypes.data + 16]  # the ids' own memory
    assert run_ids.tensor(1) is made[1]  # made once a job
    assert _RunIds(ids, torch.device("cpu"), [(0, 6, 5)]).tensor(0).tolist() == [9, 4, 7, 2, 8]
    on_meta = _RunIds(ids, META, runs)
    assert [(on_meta.tensor(n).device, on_meta.tensor(n).shape) for n in (0, 1)] == [(META, (2,)), (META, (3,))]


@pytest.mark.parametrize(
    ("shape", "permutation", "dim", "dense"),
    [
        ((2, 5, 3, 4), (0, 1, 2, 3), 1, True),
        ((2, 5, 3, 4), (0, 1, 3, 2), 1, False),  # the last two dims swapped
        ((2, 5, 3, 4), (0, 1, 3, 2), 2, False),  # one dim after, strided
        ((2, 5, 3, 4), (0, 2, 1, 3), 2, True),  # dims before dim swapped
        ((2, 5, 1, 4), (0, 1, 3, 2), 1, True),  # a dim of one: any stride
        ((2, 5, 3, 4), (1, 0, 2, 3), 1, True),  # dims before dim do not count
        ((2, 5, 3, 4), (0, 1, 2, 3), 3, True),  # nothing after
    ],
)
def test_dense_after(shape, permutation, dim, dense):
    tensor = torch.zeros(shape).permute(permutation)
    assert kvhost_torch.backend._dense_after(tensor, dim) is dense


def _layer_of_cross_layer_buffer() -> torch.Tensor:
    """The second of two layers whose blocks interleave in one buffer ``[B, layer, K, N, H,
    C]``: a KBNHC tensor whose blocks lie two regions apart under each index of K."""
    buffer = torch.zeros([SIZES["B"], 2, *(SIZES[a] for a in "KNHC")], dtype=torch.bfloat16)
    return buffer[:, 1].transpose(0, 1)


@pytest.mark.parametrize(
    ("src_physical", "dst_physical", "host_thread_bytes", "takes", "selects"),
    [
        ("KBNHC", "KBNHC", None, 2, 0),  # every block's bytes one run under each K, on both sides: take per K
        ("KBNHC", "KBNHC", 769, 2, 0),  # 3 blocks of 256 bytes: under the bound
        ("KBNHC", "KBNHC", 768, 0, 1),  # at it: torch's gather along B
        ("BKNHC", "BKNHC", None, 1, 0),  # B first: one take over the whole tensor
        ("KBNHC", "BKNHC", None, 0, 1),  # B first in the destination only: the source's blocks are not packed
        ("cross-layer", "KBNHC", None, 0, 1),  # the source's blocks apart (numpy would copy it whole first)
        ("KBNHC", "KBHNC", None, 0, 2),  # the destination's slices not dense: torch's, per K
    ],
)
def test_host_gathers_under_host_thread_bytes_are_numpys_take_where_blocks_are_packed(
    monkeypatch, src_physical, dst_physical, host_thread_bytes, takes, selects
):
    """Blocks of 256 bytes, 3 ids into a destination run, on the default torch path: every
    block lands, the others and the source keep their bytes."""
    cross_layer = src_physical == "cross-layer"
    source = _layer_of_cross_layer_buffer() if cross_layer else make_cache("KBNHC", src_physical, SIZES)
    src = {"l": fill_random(source, 1)}
    dst = {"l": fill_random(make_cache("KBNHC", dst_physical, SIZES), 2)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    src_ids, dst_ids = [5, 2, 7], [3, 4, 5]
    took = _calls_counted(monkeypatch, np, "take")
    selected = _gathers_counted(monkeypatch)
    kvhost.copy_blocks(
        src, dst, src_ids, dst_ids, axes="KBNHC", backend=TorchBackend(host_thread_bytes=host_thread_bytes)
    )
    monkeypatch.undo()
    assert (len(took), len(selected)) == (takes, selects)
    case.check(src_ids, dst_ids)


def test_host_gather_through_take_moves_pieces_of_a_mib(monkeypatch):
    """Blocks of 1 MiB a K/V half (128 tokens x 32 heads x 128 channels bf16), fresh tensors
    of 12 MiB, under a bound raised to 64 MiB: numpy's take, one call per K, lands every
    block and leaves the rest."""
    sizes = dict(K=2, B=6, N=128, H=32, C=128)
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", sizes), 3)}
    dst = {"l": fill_random(make_cache("KBNHC", "KBNHC", sizes), 4)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    took = _calls_counted(monkeypatch, np, "take")
    kvhost.copy_blocks(src, dst, [5, 0, 3], [1, 2, 3], axes="KBNHC", backend=TorchBackend(host_thread_bytes=64 << 20))
    monkeypatch.undo()
    assert len(took) == 2
    case.check([5, 0, 3], [1, 2, 3])


@pytest.mark.parametrize(
    ("axes", "src_physical", "dst_physical", "split_bytes", "calls"),
    [
        ("KBNHC", "KBNHC", "KBNHC", 768 << 10, 2),  # per index of K: 768 KiB each, at the bound
        ("KBNHC", "KBNHC", "KBNHC", (768 << 10) + 1, 1),  # under it: one call along B
        ("KBNHC", "KBHNC", "KBNHC", (768 << 10) + 1, 2),  # the source's slices are not dense: split at any size
        ("KBNHC", "KBHNC", "KBNHC", None, 2),
        ("KBNHC", "KBNHC", "KBHNC", None, 2),  # nor the destination's
        ("KBNHC", "KBNHC", "BKNHC", 768 << 10, 1),  # B first in the destination: nothing to split
        ("KBNHC", "KBNHC", "BKNHC", (1536 << 10) + 1, 1),
        ("LKBNHC", "LKBNHC", "LKBNHC", 768 << 10, 6),  # L x K: 4.5 MiB in 6 calls
        ("LKBNHC", "LKBNHC", "LKBNHC", (768 << 10) + 1, 1),
        ("KBNHC", "KBNHC", "KBNHC", None, 1),  # the default bound: 8 MiB a call
    ],
)
def test_host_gathers_go_per_index_before_b_from_host_split_bytes_a_call(
    monkeypatch, axes, src_physical, dst_physical, split_bytes, calls
):
    """Blocks of 64 KiB a layer (the bench's), 24 ids into a buffer's run: 1.5 MiB, one
    ``index_select`` per index of the dims before B in the destination where each such call
    moves ``host_split_bytes`` or more; every block lands, the rest keep their bytes. Fresh
    tensors of 3-6 MiB (the sizes a use-after-free hides below)."""
    sizes = {a: dict(L=3, K=2, B=48, N=16, H=8, C=128)[a] for a in axes}
    src = {"l": fill_random(make_cache(axes, src_physical, sizes), 5)}
    dst = {"l": fill_random(make_cache(axes, dst_physical, sizes), 6)}
    case = CopyCase(src, dst, axes, axes)
    src_ids = [int(i) for i in np.random.default_rng(3).permutation(48)[:24]]
    dst_ids = list(range(10, 34))
    gathers = _gathers_counted(monkeypatch)
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes=axes, backend=TorchBackend(host_split_bytes=split_bytes))
    monkeypatch.undo()
    assert len(gathers) == calls
    case.check(src_ids, dst_ids)


@pytest.mark.parametrize(
    ("channels", "dtype", "moved_as"),
    [(4, torch.bfloat16, torch.int64), (3, torch.bfloat16, torch.int16), (4, torch.float8_e4m3fn, torch.uint8)],
)
def test_host_copies_move_8_byte_integers_where_the_last_dim_allows(monkeypatch, channels, dtype, moved_as):
    """A scatter (``index_copy_``) on the host moves 8-byte elements where a channel row is a
    multiple of 8 bytes (4 x bf16), the raw item otherwise (3 x bf16: 6 bytes; 4 x fp8)."""
    sizes = dict(SIZES, C=channels)
    src = {"l": fill_random(make_cache("KBNHC", "KBHNC", sizes, dtype=dtype), 1)}
    dst = {"l": fill_random(make_cache("KBNHC", "KBNHC", sizes, dtype=dtype), 2)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    seen: list[torch.dtype] = []
    original = torch.Tensor.index_copy_

    def recording(self, *args):  # type: ignore[no-untyped-def]
        seen.append(self.dtype)
        return original(self, *args)

    monkeypatch.setattr(torch.Tensor, "index_copy_", recording)
    kvhost.copy_blocks(src, dst, [0, 1, 2], [6, 3, 5], axes="KBNHC", backend=TorchBackend(host_thread_bytes=0))
    monkeypatch.undo()
    assert seen == [moved_as]
    case.check([0, 1, 2], [6, 3, 5])


def test_a_registered_copy_makes_its_views_once(monkeypatch):
    # The torch path keeps each pair's views with the copy group: a connector's second
    # save with other ids makes none, and still moves exactly its blocks.
    cache = {f"l{i}": fill_random(make_cache("KBNHC", "KBNHC", SIZES), i) for i in range(3)}
    buffer = {name: torch.zeros_like(t) for name, t in cache.items()}
    host = kvhost.KVHost(cache, axes="KBNHC", backend=TorchBackend())
    host.copy_to(buffer, [4, 5], [0, 1]).wait()
    permutes = counted(monkeypatch, "permute")
    host.copy_to(buffer, [7, 2, 3], [2, 3, 4]).wait()
    assert permutes == []
    for name in cache:
        assert torch.equal(raw(buffer[name])[:, :5], raw(cache[name])[:, [4, 5, 7, 2, 3]])
        assert not raw(buffer[name])[:, 5:].any()


def test_views_of_memory_without_an_address_are_made_on_every_call():
    # XLA tensors (like meta ones here) have no address; their views are not kept.
    from kvhost_torch.backend import _pair_views

    from kvhost.batch import plan_copy_batch
    from kvhost.caches import CacheSet

    src = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES, device=META)}, "KBNHC")
    dst = CacheSet({"l": make_cache("KBNHC", "KBHNC", SIZES, device=META)}, "KBNHC")
    (job,) = plan_copy_batch(src, dst, [1, 2], [3, 4], False).jobs
    first = _pair_views(job)
    assert _pair_views(job) is not first and "torch views" not in job.group.derived
    assert first[0].source.dtype == first[0].dest.dtype == torch.int16  # widened on the host only
    host = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES)}, "KBNHC")
    for one_side in ((host, dst), (src, host)):  # one side with an address is not enough
        (job,) = plan_copy_batch(*one_side, [1, 2], [3, 4], False).jobs
        assert _pair_views(job) is not _pair_views(job) and "torch views" not in job.group.derived
    (job,) = plan_copy_batch(host, host, [1, 2], [3, 4], False).jobs
    assert _pair_views(job) is _pair_views(job) is job.group.derived["torch views"]
    assert _pair_views(job)[0].source.dtype == torch.int64


# --- the CPU backend with and without its kernels ------------------------------------------


class _NoTorchPath:
    def receive(self, job):  # type: ignore[no-untyped-def]
        raise AssertionError("host work went to the torch path although the kernels are here")

    copy = receive


def test_the_cpu_backend_runs_its_kernels_on_host_memory():
    from kvhost_cpu import CpuBackend

    backend = CpuBackend()
    assert backend.describe() == "numba kernels"
    backend.torch_path = _NoTorchPath()  # type: ignore[assignment]
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=2)
    case.send("r", [1, 4], "HNC", 4)
    kvhost.receive(caches, {"r": [1, 4]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=backend)
    case.check()
    other = {"l": make_cache("KBNHC", "KBHNC", SIZES)}
    kvhost.copy_blocks(caches, other, [1], [2], axes="KBNHC", backend=backend)
    assert torch.equal(raw(other["l"][:, 2]), raw(caches["l"][:, 1]))


def test_a_cpu_copy_runs_on_a_thread_already_inside_a_launch():
    """A device copy's handle dropped inside a launch (the collector runs at any allocation)
    finishes a bounced save with a CPU copy on that thread: it must not wait on itself."""
    import kvhost_cpu.backend as cpu

    source = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    buffer = {"l": torch.zeros_like(source["l"])}
    host = kvhost.KVHost(source, axes="KBNHC", backend=cpu.CpuBackend())
    done = threading.Event()

    def nested() -> None:
        with cpu._launch:
            host.copy_to(buffer, [1, 4], [0, 2]).wait()
        done.set()

    threading.Thread(target=nested, daemon=True).start()
    assert done.wait(30), "a copy inside a launch waited on its own thread"
    assert torch.equal(raw(buffer["l"])[:, [0, 2]], raw(source["l"])[:, [1, 4]])


def test_the_cpu_backend_works_out_a_group_s_launch_once(monkeypatch):
    # What the kernels need from a group (parameters, addresses) is kept with the group:
    # a connector's later calls work none of it out again, and still move exactly their blocks.
    import kvhost_cpu.backend as cpu

    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", SIZES) for i in range(3)}
    buffer = {name: torch.zeros_like(t) for name, t in caches.items()}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=cpu.CpuBackend())
    case = ReceiveCase(caches, "KBNHC", seed=4)
    case.send("a", [1, 4], "HNC", 4)
    host.receive({"a": [1, 4]}, remote_order="HNC", remote_block_size=4)
    host.copy_to(buffer, [1], [0]).wait()
    (receive_group,) = host.caches.receive_groups("HNC", 4)
    launch = receive_group.derived["cpu"]
    worked_out: list[object] = []
    monkeypatch.setattr(cpu.CpuBackend, "_receive_launch", lambda *args: worked_out.append(args))
    monkeypatch.setattr(cpu, "_copy_params", lambda *args: worked_out.append(args))
    case.send("b", [6, 2], "HNC", 4)
    host.receive({"b": [6, 2]}, remote_order="HNC", remote_block_size=4)
    host.copy_to(buffer, [6, 7], [1, 2]).wait()
    assert worked_out == [] and receive_group.derived["cpu"] is launch
    case.check()
    for name in caches:
        assert torch.equal(raw(buffer[name])[:, :3], raw(caches[name])[:, [1, 6, 7]])
        assert not raw(buffer[name])[:, 3:].any()


@pytest.mark.parametrize(
    ("axes", "physical", "sizes", "order", "remote", "cycles"),
    [
        # Runs of 512 B (256 bf16 channels): the cycles, whatever the piece (here 64 KiB).
        ("KBNHC", "KBNHC", dict(K=2, B=3, N=64, H=2, C=256), "HNC", 16, 512),
        # Runs of 256 B in a piece of 32 KiB: through a scratch, which stays in cache.
        ("KBNHC", "KBNHC", dict(K=2, B=3, N=64, H=2, C=128), "HNC", 16, 0),
        # Runs of 256 B in rows of 16 layers, a piece of 2 MiB: the cycles; of 15, a scratch.
        ("LBHNC", "BLNHC", dict(L=16, B=2, N=64, H=8, C=128), "HLNC", 64, 256),
        ("LBHNC", "BLNHC", dict(L=15, B=2, N=64, H=8, C=128), "HLNC", 64, 0),
        # Runs of 128 B, or 192 B, in a piece of 2 MiB: a scratch (the cycles would scatter small copies).
        ("LBHNC", "BLNHC", dict(L=32, B=2, N=64, H=8, C=64), "HLNC", 64, 0),
        ("LBHNC", "BLNHC", dict(L=22, B=2, N=64, H=8, C=96), "HLNC", 64, 0),
    ],
)
def test_the_cpu_kernels_take_the_cycles_for_long_runs_and_large_pieces(axes, physical, sizes, order, remote, cycles):
    """Which way a receive group's pieces are rewritten: in place by their cycles (the
    chunk size in the launch, a scratch row of one chunk) or through a scratch copy of a
    piece (no chunk, a row of a piece); either way the bytes are the sender's."""
    from kvhost_cpu import CpuBackend
    from kvhost_cpu.kernels import scratch_bytes

    caches = {"l": make_cache(axes, physical, sizes)}
    host = kvhost.KVHost(caches, axes=axes, backend=CpuBackend())
    case = ReceiveCase(caches, axes, seed=5)
    case.send("a", [1], order, remote)
    host.receive({"a": [1]}, remote_order=order, remote_block_size=remote)
    case.check()
    (group,) = host.caches.receive_groups(order, remote)
    launch = group.derived["cpu"]
    write_back = group.rearrangement.write_back
    assert int(launch.params[24]) == cycles
    assert launch.scratch_bytes == scratch_bytes(launch.params)  # a row: a chunk or a piece, and room for a skew
    assert (cycles or write_back.piece_bytes) + 4095 <= launch.scratch_bytes < (cycles or write_back.piece_bytes) + 8192
    if cycles:
        assert launch.cycles == (write_back.cycles.order, write_back.cycles.starts)
    else:
        assert launch.cycles[0].size == 0 and launch.cycles[1].tolist() == [0]


@pytest.mark.parametrize("bad", [True, -1, 1.5, "512", None])
def test_the_cpu_backend_s_cycle_bounds_are_non_negative_integers(bad):
    from kvhost_cpu import CpuBackend

    for name in ("cycle_piece_bytes", "cycle_run_bytes"):
        with pytest.raises(
            kvhost.ArgumentError, match=rf"{name} must be a non-negative integer, got {re.escape(repr(bad))}"
        ):
            CpuBackend(**{name: bad})
    assert CpuBackend(cycle_piece_bytes=0, cycle_run_bytes=0).cycle_run_bytes == 0


@pytest.mark.parametrize("bad", [True, -1, 1.5, "512"])
def test_the_torch_backend_s_sizes_are_non_negative_integers_or_its_defaults(bad):
    """What plugin devices without kernels run: a bad size is refused when the backend is
    made, not met as a TypeError (or taken as given) in a call."""
    names = ("host_chunk_bytes", "device_chunk_bytes", "max_run_copies", "host_thread_bytes", "host_split_bytes")
    for name in names:
        with pytest.raises(
            kvhost.ArgumentError, match=rf"{name} must be a non-negative integer, got {re.escape(repr(bad))}"
        ):
            TorchBackend(**{name: bad})
    defaults, zeros = TorchBackend(), TorchBackend(**dict.fromkeys(names, 0))
    assert [getattr(defaults, name) for name in names] == [1 << 20, None, 64, 1 << 20, 8 << 20]
    assert [getattr(zeros, name) for name in names] == [0] * 5


def _byte_pairs(loops) -> set[tuple[int, int]]:
    """Every (source, destination) offset a copy's loops copy a run between."""
    import itertools

    return {
        (sum(i * s for i, s in zip(index, loops.src_strides)), sum(i * d for i, d in zip(index, loops.dst_strides)))
        for index in itertools.product(*(range(size) for size in loops.shape))
    }


@pytest.mark.parametrize(
    ("src", "dst", "heads", "walk", "shape"),
    [
        # A save into a head-major buffer, 8 heads: the destination's walk (K, H, N) would
        # read the cache's tokens 2 KiB apart; the source's walk (K, N, H) reads it in order.
        ("KBNHC", "KBHNC", 8, "source", (2, 16, 8)),
        # 16 heads: 4 KiB apart, a page: the destination's walk.
        ("KBNHC", "KBHNC", 16, "destination", (2, 16, 16)),
        # A load out of a buffer of blocks of 16 tokens: a token's heads are 4 KiB apart.
        ("KBHNC", "KBNHC", 8, "destination", (2, 16, 8)),
        # One layout on both sides: one run a K/V half, no stride to read at.
        ("KBNHC", "KBNHC", 8, "destination", (2,)),
    ],
)
def test_a_cpu_copy_walks_its_source_s_order_where_the_destination_s_reads_at_a_short_stride(
    src, dst, heads, walk, shape
):
    from kvhost_cpu import CpuBackend
    from kvhost_cpu.backend import walk_order

    from kvhost.batch import plan_copy_batch
    from kvhost.caches import CacheSet
    from kvhost.layout import Layout
    from kvhost.transform import plan_copy

    sizes = dict(K=2, B=4, N=16, H=heads, C=128)
    caches = [
        {"l": fill_random(make_cache("KBNHC", physical, sizes), seed)} for seed, physical in enumerate((src, dst))
    ]
    plan = plan_copy(*(Layout.of(c["l"], "KBNHC") for c in caches))
    walked = walk_order(plan.loops)
    by_source = sorted(range(len(plan.loops.shape)), key=lambda d: -plan.loops.src_strides[d])
    assert walked == (plan.loops.reordered(by_source) if walk == "source" else plan.loops)
    assert walked.shape == shape and walked.run_bytes == (32768 if src == dst else 256)
    assert walk_order(plan.loops, "source") == plan.loops.reordered(by_source)
    assert walk_order(plan.loops, "destination") == plan.loops
    assert _byte_pairs(walked) == _byte_pairs(plan.loops)
    case = CopyCase(*caches, "KBNHC", "KBNHC")
    (job,) = plan_copy_batch(
        CacheSet(caches[0], "KBNHC"), CacheSet(caches[1], "KBNHC"), [3, 0, 1], [1, 2, 3], False
    ).jobs
    CpuBackend().copy(job).wait()
    case.check([3, 0, 1], [1, 2, 3])
    launch = job.group.derived["cpu"]  # the kernels' loops (shape at 6..11, padded in front)
    for params, loops in ((launch.streamed_params, walked), (launch.cached_params, plan.loops)):
        # Streamed copies take the walk; copies under STREAM_BYTES keep the destination's.
        assert tuple(int(x) for x in params[12 - len(loops.shape) : 12]) == loops.shape
        assert tuple(int(x) for x in params[18 - len(loops.shape) : 18]) == loops.src_strides


@pytest.mark.parametrize(
    ("heads", "walk", "src_strides"), [(16, "source", (262144, 4096, 256)), (8, "destination", (131072, 256, 2048))]
)
def test_a_cpu_backend_told_a_walk_takes_it_and_keeps_its_own_copy_launch(heads, walk, src_strides):
    """A forced walk where the default takes the other (16 heads: the destination's; 8: the
    source's): each backend keeps its launch under its own key, with its own loops, and
    each copies right."""
    from kvhost_cpu import CpuBackend
    from kvhost_cpu.backend import CYCLE_PIECE_BYTES, CYCLE_RUN_BYTES

    from kvhost.batch import plan_copy_batch
    from kvhost.caches import CacheSet

    sizes = dict(K=2, B=4, N=16, H=heads, C=128)
    caches = [
        {"l": fill_random(make_cache("KBNHC", physical, sizes), seed)}
        for seed, physical in enumerate(("KBNHC", "KBHNC"))
    ]
    sets = [CacheSet(c, "KBNHC") for c in caches]
    case = CopyCase(*caches, "KBNHC", "KBNHC")
    for backend, (src_ids, dst_ids) in ((CpuBackend(), ([0], [1])), (CpuBackend(copy_walk=walk), ([2], [3]))):
        (job,) = plan_copy_batch(*sets, src_ids, dst_ids, False).jobs
        backend.copy(job).wait()
    case.check([0, 2], [1, 3])
    group = job.group
    key = f"cpu/{CYCLE_PIECE_BYTES}/{CYCLE_RUN_BYTES}/{walk}"
    assert set(group.derived) == {"cpu", key}
    default_strides = tuple(int(x) for x in group.derived["cpu"].streamed_params[15:18])
    assert tuple(int(x) for x in group.derived[key].streamed_params[15:18]) == src_strides != default_strides


def test_the_cpu_copy_walk_s_stride_bound():
    """The source's walk where the destination's reads runs of REORDER_MIN_RUN bytes or more
    less than SHORT_READ_STRIDE apart; otherwise the loops are kept as they are."""
    from kvhost_cpu.backend import REORDER_MIN_RUN, SHORT_READ_STRIDE, walk_order

    from kvhost.transform import Loops

    def heads_then_tokens(stride: int, run: int = 256) -> Loops:  # tokens `stride` apart in the source
        return Loops((2, 8, 16), (1 << 20, run, stride), (1 << 21, 16 * run, run), run)

    def tokens_then_heads(stride: int, run: int = 256) -> Loops:
        return Loops((2, 16, 8), (1 << 20, stride, run), (1 << 21, run, 16 * run), run)

    for stride, reordered in ((512, True), (SHORT_READ_STRIDE - 1, True), (SHORT_READ_STRIDE, False)):
        assert walk_order(heads_then_tokens(stride)) == (
            tokens_then_heads(stride) if reordered else heads_then_tokens(stride)
        )
        assert walk_order(heads_then_tokens(stride), "source") == tokens_then_heads(stride)
        assert walk_order(heads_then_tokens(stride), "destination") == heads_then_tokens(stride)
    # Runs of 127 B, 2 KiB apart: the destination's walk, which shorter runs favour.
    assert walk_order(heads_then_tokens(2048, 127)) == heads_then_tokens(2048, 127)
    assert walk_order(heads_then_tokens(2048, 128)) == tokens_then_heads(2048, 128)
    assert walk_order(Loops((), (), (), 4096)) == Loops((), (), (), 4096)
    assert (SHORT_READ_STRIDE, REORDER_MIN_RUN) == (4096, 128)


@pytest.mark.parametrize("bad", ["fewest", "", None, 1, "Source"])
def test_the_cpu_backend_s_copy_walk_is_one_of_its_walks(bad):
    from kvhost_cpu import CpuBackend

    walks = r"\('auto', 'destination', 'source'\)"
    with pytest.raises(kvhost.ArgumentError, match=rf"copy_walk must be one of {walks}, got {re.escape(repr(bad))}"):
        CpuBackend(copy_walk=bad)
    assert CpuBackend(copy_walk="source").copy_walk == "source"


def test_cpu_backends_that_choose_other_ways_keep_their_own_launches():
    """A group's launch is kept per way of choosing: the default backend's and one that takes
    the cycles for every piece each keep their own, and each receives right."""
    from kvhost_cpu import CpuBackend

    from kvhost.batch import plan_receive_batch
    from kvhost.caches import CacheSet

    caches = {"l": make_cache("KBNHC", "KBNHC", dict(K=2, B=6, N=8, H=2, C=4))}
    cache_set = CacheSet(caches, "KBNHC")  # one set, as a connector's is, met by both backends
    case = ReceiveCase(caches, "KBNHC", seed=6)
    for backend, ids in ((CpuBackend(), [1, 3]), (CpuBackend(cycle_piece_bytes=0, cycle_run_bytes=0), [4, 0])):
        case.send(str(ids), ids, "HNC", 4)
        (job,) = plan_receive_batch(cache_set, {str(ids): ids}, "HNC", 4).jobs
        backend.receive(job)
    case.check()
    (group,) = cache_set.receive_groups("HNC", 4)
    launches = dict(group.derived)
    assert set(launches) == {"cpu", "cpu/0/0/auto"}
    assert int(launches["cpu"].params[24]) == 0 and int(launches["cpu/0/0/auto"].params[24]) > 0


def test_a_group_on_memory_without_an_address_is_marked_for_the_torch_path():
    from kvhost_cpu import CpuBackend

    from kvhost.batch import plan_copy_batch, plan_receive_batch
    from kvhost.caches import CacheSet

    class Recorded:
        def __init__(self) -> None:
            self.jobs: list[object] = []

        def receive(self, job):  # type: ignore[no-untyped-def]
            self.jobs.append(job)

        copy = receive

    backend = CpuBackend()
    backend.torch_path = Recorded()  # type: ignore[assignment]
    meta = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES, device=META)}, "KBNHC")
    (receive_job,) = plan_receive_batch(meta, {"r": [1, 2]}, "HNC", 4).jobs
    (copy_job,) = plan_copy_batch(meta, meta, [1], [2], False).jobs
    for _ in range(2):
        backend.receive(receive_job)
        backend.copy(copy_job)
    assert backend.torch_path.jobs == [receive_job, copy_job] * 2  # type: ignore[attr-defined]
    assert receive_job.group.derived["cpu"] is False and copy_job.group.derived["cpu"] is False


def test_without_numba_the_cpu_backend_runs_the_torch_path(monkeypatch):
    import kvhost_cpu.backend as cpu

    monkeypatch.setattr(cpu, "KERNELS", OptionalKernels("kvhost_cpu.no_such_kernels"))
    backend = cpu.CpuBackend()
    assert backend.describe() == "torch ops (numba unavailable: No module named 'kvhost_cpu.no_such_kernels')"
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=3)
    case.send("r", [2, 5], "HNC", 2)
    stats = kvhost.receive(
        caches, {"r": [2, 5]}, axes="KBNHC", remote_order="HNC", remote_block_size=2, backend=backend
    )
    case.check()
    assert stats.backend == "cpu"
    other = {"l": make_cache("KBNHC", "KBHNC", SIZES)}
    kvhost.copy_blocks(caches, other, [2], [3], axes="KBNHC", backend=backend)
    assert torch.equal(raw(other["l"][:, 3]), raw(caches["l"][:, 2]))


def test_the_cpu_backend_ranks_above_the_torch_backend_and_below_plugins():
    from kvhost_cpu import CpuBackend

    assert CpuBackend.priority == 0  # docs/plugins.md: "kvhost's cpu backend is 0"


def test_the_receive_scratch_is_kept_grown_and_let_go():
    from kvhost_cpu.backend import _Scratch

    mib = 1 << 20
    scratch = _Scratch()
    first = scratch.rows(2, 100)
    assert first.shape == (2, 100) and first.dtype == np.uint8
    assert scratch.rows(2, 100) is first  # fits exactly: kept
    assert scratch.rows(1, 10) is first  # needs less: kept
    assert scratch.rows(4, 100).shape == (4, 100)  # more threads: grown
    assert scratch.rows(2, 300).shape == (4, 300)  # longer rows: grown, the rows it had kept
    # While calls are under way it only grows: what a call reserved before its first job
    # is there for its last, whatever another call under way asks for in between.
    scratch = _Scratch()
    with scratch.call():
        big = scratch.rows(2, 50 * mib)  # 100 MiB
        with scratch.call():
            assert scratch.rows(1, 10) is big
        assert scratch.rows(1, 10) is big  # the other call ended; this one is still under way
    assert scratch.rows(1, 10) is big  # the calls needed all of it: kept
    # The last call under way to end lets go of a buffer over 64 MiB and over 4 times what
    # the calls needed.
    with scratch.call():
        scratch.rows(2, 50 * mib // 4)  # 4 x 2 x 12.5 MiB = 100 MiB: kept
    assert scratch.rows(1, 1) is big
    with scratch.call():
        scratch.rows(2, 50 * mib // 4 - 1)
    assert scratch.rows(1, 1).shape == (1, 1)  # just under a quarter: let go, made anew as asked
    scratch = _Scratch()
    with scratch.call():
        kept = scratch.rows(1, 64 * mib)
    with scratch.call():
        scratch.rows(1, 10)
    assert scratch.rows(1, 10) is kept  # up to 64 MiB is kept whatever the calls needed
    with scratch.call():
        over = scratch.rows(1, 64 * mib + 1)
    with scratch.call():
        scratch.rows(1, 10)
    assert scratch.rows(1, 10) is not over


def test_a_machine_short_of_memory_for_a_later_job_s_scratch_refuses_the_call_before_any_job_runs(monkeypatch):
    """Every job's scratch is reserved before any job runs: no room for the second job's
    (2 x 1 MiB) is a BackendError with no byte written. It had left the first job rearranged
    in place, and a MemoryError, not a KVHostError; a second try rearranged it again."""
    import kvhost_cpu.backend as cpu

    monkeypatch.setattr(cpu, "_scratch", cpu._Scratch())
    caches = {"l0": make_cache("BNHC", "BNHC", dict(B=16, N=256, H=16, C=128), torch.bfloat16)}
    case = ReceiveCase(caches, "BNHC")
    case.send("a", [0, 1], "HNC", 64)  # r = 4: pieces of 256 KiB
    case.send("b", [2, 3], "HNC", 256)  # pieces of 1 MiB
    requests = {
        name: kvhost.Incoming(w.block_ids, w.remote_order, w.remote_block_size) for name, w in case.requests.items()
    }
    saved, asked = case.snapshot(), []

    class ShortOfMemory:
        """numpy, whose ``empty`` finds no room for more than 1.5 MiB."""

        def __getattr__(self, name):
            return getattr(np, name)

        def empty(self, shape, dtype=float):
            asked.append(shape)
            if np.prod(shape) > 1.5 * (1 << 20):
                raise MemoryError(f"Unable to allocate an array with shape {shape}")
            return np.empty(shape, dtype=dtype)

    monkeypatch.setattr(cpu, "np", ShortOfMemory())
    with pytest.raises(kvhost.BackendError, match=r"no memory for a receive's scratch of \d+ x [\d,]+ bytes .*nothing"):
        kvhost.receive(caches, requests, axes="BNHC", backend="cpu")
    assert len(asked) == 2 and case.same_as(saved)
    monkeypatch.setattr(cpu, "np", np)
    kvhost.receive(caches, requests, axes="BNHC", backend="cpu")
    case.check()


def test_jobs_under_1_mib_run_on_the_calling_thread(monkeypatch):
    import kvhost_cpu.kernels as kernels

    monkeypatch.setattr(kernels, "threads", lambda: 4)  # as on a machine with 4 cores
    assert kernels.launcher("copy_runs", (1 << 20) - 1) == (kernels.copy_runs_serial, 1)
    assert kernels.launcher("copy_runs", 1 << 20) == (kernels.copy_runs, 4)
    monkeypatch.setattr(kernels, "threads", lambda: 1)
    assert kernels.launcher("rearrange_units", 1 << 30) == (kernels.rearrange_units_serial, 1)


def test_each_launch_is_sized_by_the_bytes_it_moves(monkeypatch):
    # The launch size picks the calling thread or every thread (1 MiB): it must be the
    # call's bytes, not the first call's, for a registered cache's every call.
    import kvhost_cpu.kernels as kernels
    from kvhost_cpu import CpuBackend

    asked: list[tuple[str, int]] = []
    launcher = kernels.launcher

    def recording(name: str, nbytes: int):  # type: ignore[no-untyped-def]
        asked.append((name, nbytes))
        return launcher(name, nbytes)

    monkeypatch.setattr(kernels, "launcher", recording)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", SIZES) for i in range(2)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=CpuBackend())
    two = host.receive({"a": [1, 2]}, remote_order="HNC", remote_block_size=4)
    five = host.receive({"a": [3, 4, 5], "b": [6, 0]}, remote_order="HNC", remote_block_size=4)
    assert two.bytes_moved == 2 * 2 * 2 * (8 * 2 * 4 * 2)  # blocks x layers x K/V x block bytes
    # Each asked twice: the check that reserves the scratch before any job runs, then the launch.
    assert asked == [("rearrange_units", two.bytes_moved)] * 2 + [("rearrange_units", five.bytes_moved)] * 2
    assert five.bytes_moved == two.bytes_moved * 5 // 2
    buffer = {name: torch.zeros_like(t) for name, t in caches.items()}
    saved = host.copy_to(buffer, [1, 2, 7], [0, 1, 2]).wait()
    assert saved.bytes_moved == 3 * 2 * 2 * (8 * 2 * 4 * 2)
    assert asked[4:] == [("copy_runs", saved.bytes_moved)]


def test_copy_work_items_hold_at_most_2_mib_of_blocks_and_at_least_one_block():
    from kvhost_cpu.backend import _copy_params

    from kvhost.layout import Layout
    from kvhost.transform import plan_copy

    def most_blocks(block: torch.Tensor) -> int:
        layout = Layout.of(block, "BNC")
        plan = plan_copy(layout, layout)
        return int(_copy_params(plan, plan.loops, False)[4])

    assert most_blocks(torch.empty(4, 8, 16, device=META)) == (2 << 20) // 512  # 512-byte blocks
    assert most_blocks(torch.empty(2, 1024, 1024, device=META)) == 1  # a 4 MiB block is an item alone


# --- streamed stores ---------------------------------------------------------------------


def _kernel_params_seen(monkeypatch) -> list[tuple[int, int]]:
    """(stream flag, threads) of every copy kernel launch from here on; the launches still run."""
    import kvhost_cpu.kernels as kernels

    seen: list[tuple[int, int]] = []
    launcher = kernels.launcher

    def recording(name: str, nbytes: int):  # type: ignore[no-untyped-def]
        kernel, threads = launcher(name, nbytes)

        def run(*args):  # type: ignore[no-untyped-def]
            seen.append((int(args[4][5]), threads))
            return kernel(*args)

        return run, threads

    monkeypatch.setattr(kernels, "launcher", recording)
    return seen


@pytest.mark.parametrize("block_bytes", [40961, 4097, 300, 255, 127])
def test_copies_of_1_mib_and_more_stream_their_runs_exactly(monkeypatch, block_bytes):
    # Odd block sizes put every destination run at another alignment; runs of 127 bytes
    # are too short to stream and take the cached path inside a streamed copy. Ids in
    # runs and alone; every byte of every block not written keeps its sentinel.
    import kvhost_cpu.kernels as kernels

    blocks = -(-kernels.STREAM_BYTES // block_bytes) * 2 + 8
    src = {"l": torch.randint(0, 256, (blocks, 1, block_bytes), dtype=torch.uint8)}
    dst = {"l": torch.full((blocks, 1, block_bytes), 0xA5, dtype=torch.uint8)}
    count = blocks // 2 + 2  # at least 1 MiB
    src_ids = [*range(3, 3 + count - 3), 0, blocks - 1, 1]
    dst_ids = [*range(blocks - count + 3, blocks), 1, 0, 5]
    seen = _kernel_params_seen(monkeypatch)
    result = kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="BNC").wait()
    assert result.bytes_moved == count * block_bytes >= kernels.STREAM_BYTES
    assert [flag for flag, _ in seen] == [1]
    assert torch.equal(dst["l"][dst_ids], src["l"][src_ids])
    untouched = sorted(set(range(blocks)) - set(dst_ids))
    assert untouched and bool((dst["l"][untouched] == 0xA5).all())


def test_copies_under_1_mib_write_through_the_caches(monkeypatch):
    import kvhost_cpu.kernels as kernels

    seen = _kernel_params_seen(monkeypatch)
    src = {"l": torch.randint(0, 256, (64, 1, 1 << 14), dtype=torch.uint8)}
    dst = {"l": torch.zeros(64, 1, 1 << 14, dtype=torch.uint8)}
    kvhost.copy_blocks(src, dst, list(range(63)), list(range(63)), axes="BNC").wait()  # 1 MiB - 16 KiB
    kvhost.copy_blocks(src, dst, list(range(64)), list(range(64)), axes="BNC").wait()  # 1 MiB
    assert seen == [(0, 1), (1, kernels.threads())]
    assert torch.equal(dst["l"], src["l"])


# --- runs of any length ---------------------------------------------------------------------


@pytest.mark.parametrize("channels", [31, 33, 64, 66])
def test_runs_of_any_byte_length_copy_exactly_their_bytes(target, channels):
    # One-byte items: a token's channels are a run of 31, 33, 64 or 66 bytes, which the
    # kernels copy in 32-byte moves when they can and byte-exact otherwise.
    sizes = dict(K=2, B=8, N=4, H=3, C=channels)
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", sizes, torch.uint8, target.device), 1)}
    dst = {"l": fill_random(make_cache("KBNHC", "KBHNC", sizes, torch.uint8, target.device), 2)}
    before = raw(dst["l"]).cpu().clone()
    kvhost.copy_blocks(src, dst, [0, 5, 6], [7, 1, 2], axes="KBNHC", backend=target.backend).completion.wait()
    now = raw(dst["l"]).cpu()
    for s, d in zip([0, 5, 6], [7, 1, 2]):
        assert torch.equal(now[:, d], raw(src["l"]).cpu()[:, s])
    for block in (0, 3, 4, 5, 6):
        assert torch.equal(now[:, block], before[:, block]), f"block {block} changed"
    caches = {"l": make_cache("KBNHC", "KBHNC", sizes, torch.uint8, target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=channels)
    case.send("r", [6, 2, 3], "NHC", 2)
    kvhost.receive(
        caches, {"r": [6, 2, 3]}, axes="KBNHC", remote_order="NHC", remote_block_size=2, backend=target.backend
    )
    case.check()


def test_loops_with_every_letter_apart(target):
    # Layers and K/V inside each block, and a sender (or a destination) whose order
    # reverses every letter: nothing merges, so the kernels walk all six loop dims (five
    # for the copy), each of a different size.
    sizes = dict(B=6, L=3, K=2, H=4, N=4, C=5)
    caches = {"x": make_cache("BLKHNC", "BLKHNC", sizes, device=target.device)}
    case = ReceiveCase(caches, "BLKHNC", seed=12)
    case.send("r", [4, 1], "CNHKL", 2)
    kvhost.receive(
        caches, {"r": [4, 1]}, axes="BLKHNC", remote_order="CNHKL", remote_block_size=2, backend=target.backend
    )
    case.check()
    src = {"x": fill_random(make_cache("LKBHNC", "LKBHNC", sizes, device=target.device), 3)}
    dst = {"x": fill_random(make_cache("LKBHNC", "BCNHKL", sizes, device=target.device), 4)}
    before = raw(dst["x"]).cpu().clone()
    kvhost.copy_blocks(src, dst, [5, 0, 1], [2, 3, 4], axes="LKBHNC", backend=target.backend).completion.wait()
    now, source = raw(dst["x"]).cpu(), raw(src["x"]).cpu()
    for s, d in zip([5, 0, 1], [2, 3, 4]):
        assert torch.equal(now[:, :, d], source[:, :, s])
    for block in (0, 1, 5):
        assert torch.equal(now[:, :, block], before[:, :, block])


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "max_run_copies", "passes"),
    [
        # Two runs, the destination's one: gathered straight into it, no copy per run.
        ([5, 1], [2, 3], 64, dict(copy_=0, index_select=0, index_copy_=0)),
        # Three runs, more than max_run_copies, the destination's one (as many as it allows).
        ([0, 5, 3], [5, 6, 7], 1, dict(copy_=0, index_select=0, index_copy_=0)),
        # Three runs, the source's one: scattered straight from it, no gather.
        ([0, 1, 2], [5, 2, 7], 1, dict(copy_=0, index_select=0, index_copy_=1)),
        # Both sides scattered: a gather, then a scatter.
        ([0, 5, 3], [5, 2, 7], 1, dict(copy_=0, index_select=1, index_copy_=1)),
    ],
)
def test_a_copy_takes_the_fewest_passes(monkeypatch, src_ids, dst_ids, max_run_copies, passes):
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)}
    dst = {"l": torch.zeros_like(src["l"])}
    calls = {method: counted(monkeypatch, method) for method in passes}
    backend = TorchBackend(max_run_copies=max_run_copies, host_thread_bytes=0)  # torch's ops for every call
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=backend)
    assert {method: len(made) for method, made in calls.items()} == passes
    assert torch.equal(raw(dst["l"])[:, dst_ids], raw(src["l"])[:, src_ids])
    others = [b for b in range(raw(dst["l"]).shape[1]) if b not in dst_ids]
    assert not raw(dst["l"])[:, others].any()


def _gathers_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``torch.index_select`` function calls (the gathers into destination runs)."""
    return _calls_counted(monkeypatch, torch, "index_select")


def _calls_counted(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Count calls of the function ``name`` of ``owner`` (a module, a class or an instance)."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "passes"),
    [
        ([4, 5, 6], [0, 1, 2], dict(copy_=1, index_select=0, index_copy_=0)),  # one run on both sides
        ([7, 2, 3], [4, 0, 1], dict(copy_=2, index_select=0, index_copy_=0)),  # both sides in two runs alike
        ([5, 1, 2], [0, 1, 2], dict(copy_=0, index_select=1, index_copy_=0)),  # gathered into one run
        ([0, 1, 2], [5, 2, 3], dict(copy_=0, index_select=0, index_copy_=1)),  # scattered from one run
    ],
)
def test_a_host_copy_makes_one_call_per_run_of_the_side_with_fewest(monkeypatch, src_ids, dst_ids, passes):
    src = {f"l{i}": fill_random(make_cache("KBNHC", "KBNHC", SIZES), i) for i in range(3)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    gathers = _gathers_counted(monkeypatch)
    made = {method: counted(monkeypatch, method) for method in ("copy_", "index_copy_")}
    backend = TorchBackend(host_thread_bytes=0)  # torch's ops for every call, as on a device
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=backend).wait()
    calls = {"index_select": len(gathers), **{method: len(c) for method, c in made.items()}}
    assert calls == {method: 3 * count for method, count in passes.items()}
    others = [b for b in range(SIZES["B"]) if b not in dst_ids]
    for name in src:
        assert torch.equal(raw(dst[name])[:, dst_ids], raw(src[name])[:, src_ids])
        assert not raw(dst[name])[:, others].any()


@pytest.mark.parametrize(
    ("max_run_copies", "passes"), [(2, dict(copy_=6, index_copy_=0)), (1, dict(copy_=0, index_copy_=3))]
)
def test_a_copy_within_one_cache_copies_each_run(monkeypatch, max_run_copies, passes):
    # One storage on both sides: no one-pass index op, a copy_ per run up to max_run_copies.
    cache = {f"l{i}": fill_random(make_cache("KBNHC", "KBNHC", SIZES), i) for i in range(3)}
    before = {name: raw(t).clone() for name, t in cache.items()}
    made = {method: counted(monkeypatch, method) for method in passes}
    gathers = _gathers_counted(monkeypatch)
    backend = TorchBackend(max_run_copies=max_run_copies, host_thread_bytes=0)
    kvhost.copy_blocks(cache, cache, [0, 1, 4], [2, 3, 6], axes="KBNHC", backend=backend).wait()  # two runs
    assert {method: len(calls) for method, calls in made.items()} == passes and gathers == []
    for name, tensor in cache.items():
        expected = before[name].clone()
        expected[:, [2, 3, 6]] = before[name][:, [0, 1, 4]]
        assert torch.equal(raw(tensor), expected)


@pytest.mark.parametrize(
    ("device", "src_ids", "dst_ids", "max_run_copies", "dst_runs", "src_runs"),
    [
        # One run both sides is one copy_ a layer: no index runs.
        ("meta", [4, 5, 6], [0, 1, 2], 64, [], []),
        ("cpu", [4, 5, 6], [0, 1, 2], 64, [], []),
        # The destination in fewer runs than both sides together.
        ("meta", [5, 1], [2, 3], 64, [(0, 2, 2)], []),
        # The source in fewer: scattered from.
        ("meta", [0, 1, 2], [5, 2, 7], 64, [], [(0, 0, 3)]),
        ("cpu", [0, 1, 2], [5, 2, 7], 64, [], [(0, 0, 3)]),
        ("cpu", [0, 1, 2], [5, 2, 7], 1, [], [(0, 0, 3)]),  # one run is within any max_run_copies
        # The destination in fewer runs, but more than max_run_copies: the source's one.
        ("meta", [0, 1, 3, 4, 6, 7], [0, 2, 3, 5, 6, 1], 3, [], [(0, 0, 2), (2, 3, 2), (4, 6, 2)]),
        # Both sides in as many runs as both together: neither.
        ("meta", [0, 5, 3], [5, 2, 7], 64, [], []),
        # Two devices: copy_ moves the bytes across.
        (("meta", "cpu"), [5, 1], [2, 3], 64, [], []),
        ("cpu", [0, 5, 3], [5, 2, 7], 2, [], []),
    ],
)
def test_the_side_a_copy_runs_by(device, src_ids, dst_ids, max_run_copies, dst_runs, src_runs):
    from kvhost.batch import plan_copy_batch
    from kvhost.caches import CacheSet

    src_device, dst_device = (device, device) if isinstance(device, str) else device
    src = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES, device=torch.device(src_device))}, "KBNHC")
    dst = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES, device=torch.device(dst_device))}, "KBNHC")
    (job,) = plan_copy_batch(src, dst, src_ids, dst_ids, False).jobs
    assert TorchBackend(max_run_copies=max_run_copies)._index_runs(job) == (dst_runs, src_runs)


# --- the runs the copy kernel finds -------------------------------------------------------


def _runs_reference(src: list[int], dst: list[int], most: int) -> list[tuple[int, int]]:
    """(start, length) of each run consecutive on both sides, cut at ``most``, from the left."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(src):
        length = 1
        while (
            i + length < len(src)
            and length < most
            and src[i + length] == src[i + length - 1] + 1
            and dst[i + length] == dst[i + length - 1] + 1
        ):
            length += 1
        runs.append((i, length))
        i += length
    return runs


def _split(src: list[int], dst: list[int], most: int) -> list[tuple[int, int]]:
    import kvhost_cpu.kernels as kernels

    # Each list is a slice of a longer array whose next element would continue the run:
    # a kernel that read one id past the end would find a longer run.
    src_ids = np.array([*src, (src[-1] + 1) if src else 0], dtype=np.int64)[: len(src)]
    dst_ids = np.array([*dst, (dst[-1] + 1) if dst else 0], dtype=np.int64)[: len(dst)]
    starts, lengths = kernels._split_into_runs(src_ids, dst_ids, most)
    assert starts.shape == lengths.shape
    return list(zip(starts.tolist(), lengths.tolist()))


@pytest.mark.parametrize(
    ("src", "dst", "most", "runs"),
    [
        ([], [], 4, []),
        ([7], [2], 4, [(0, 1)]),
        ([3, 4, 5, 6], [0, 1, 2, 3], 8, [(0, 4)]),
        ([3, 4, 5, 6], [0, 1, 2, 3], 3, [(0, 3), (3, 1)]),
        ([3, 4, 5, 6], [0, 1, 2, 3], 1, [(0, 1), (1, 1), (2, 1), (3, 1)]),
        ([3, 4, 5, 6], [0, 1, 5, 6], 8, [(0, 2), (2, 2)]),  # a break on the destination side only
        ([3, 4, 9, 10], [0, 1, 2, 3], 8, [(0, 2), (2, 2)]),  # on the source side only
        ([6, 5, 4], [0, 1, 2], 8, [(0, 1), (1, 1), (2, 1)]),  # descending ids are no run
        ([0, 1, 2], [6, 5, 4], 8, [(0, 1), (1, 1), (2, 1)]),
        ([5, 9, 6, 7], [0, 1, 2, 3], 8, [(0, 1), (1, 1), (2, 2)]),  # 6 follows 5, but not next to it
        ([2, 3, 2, 3], [0, 1, 0, 1], 8, [(0, 2), (2, 2)]),
    ],
)
def test_the_copy_kernel_finds_runs_consecutive_on_both_sides(src, dst, most, runs):
    # A run merged wrongly copies blocks that were not asked for; one missed only costs
    # speed, which no byte shows: so the runs are checked themselves.
    assert _runs_reference(src, dst, most) == runs
    assert _split(src, dst, most) == runs


def test_the_copy_kernel_finds_the_runs_of_random_ids():
    rng = np.random.default_rng(7)
    for _ in range(200):
        count = int(rng.integers(1, 40))
        # Allocator-like: short runs in random order, on both sides independently.
        src = np.cumsum(np.where(rng.random(count) < 0.7, 1, rng.integers(-5, 6, count))).tolist()
        dst = np.cumsum(np.where(rng.random(count) < 0.7, 1, rng.integers(-5, 6, count))).tolist()
        most = int(rng.integers(1, 10))
        assert _split(src, dst, most) == _runs_reference(src, dst, most), (src, dst, most)


# --- how the kernels copy a run ------------------------------------------------------------
# Every way moves the same bytes, so no byte check sees a wrong choice; it only costs speed.


def test_runs_of_128_bytes_and_more_of_a_streamed_copy_are_streamed():
    import kvhost_cpu.kernels as kernels

    assert kernels.STREAM_RUN == 128
    assert kernels._streams(128, True) and kernels._streams(1 << 20, True)
    assert not kernels._streams(127, True)
    assert not kernels._streams(128, False) and not kernels._streams(1 << 20, False)


@pytest.mark.parametrize(
    ("triple", "x86", "instruction"),
    [
        ("aarch64-unknown-linux-gnu", False, "dmb"),
        ("arm64-apple-darwin", False, "dmb"),
        ("x86_64-pc-linux-gnu", True, "sfence"),
    ],
)
def test_the_fence_after_streamed_stores_compiles_for_each_machine_numba_installs_on(
    triple, x86, instruction, monkeypatch
):
    """numba is a default dependency on aarch64 and arm64 macOS too, where x86's sfence makes
    LLVM abort the process: the fence is each target's own, and only x86 streams at all (what
    was measured)."""
    import kvhost_cpu.kernels as kernels
    import llvmlite.binding as llvm
    from llvmlite import ir

    from kvhost.transform import Loops

    module = ir.Module(name="fence")
    module.triple = triple
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), []), "fenced")
    builder = ir.IRBuilder(function.append_basic_block())
    kernels.emit_store_fence(builder, x86)
    builder.ret_void()
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    machine = llvm.Target.from_triple(triple).create_target_machine()
    assembly = machine.emit_assembly(llvm.parse_assembly(str(module)))
    assert re.search(rf"^\s*{instruction}\b", assembly, flags=re.M), assembly
    monkeypatch.setattr(kernels, "X86", x86)
    loops = Loops((4,), (1,), (1,), 256)
    assert kernels.copy_params(256, 256, True, 8, loops, stream=True)[5] == int(x86)
    assert kernels.copy_params(256, 256, True, 8, loops, stream=False)[5] == 0


def test_runs_of_whole_32_byte_words_up_to_1_kib_are_copied_inline():
    import kvhost_cpu.kernels as kernels

    assert kernels.SHORT_RUN == 1024
    assert all(kernels._inline(n) for n in (32, 64, 992, 1024))
    assert not any(kernels._inline(n) for n in (1056, 2048, 33, 100, 1023))


def test_every_streamed_run_of_128_to_255_bytes_stays_within_its_bytes():
    """At every alignment: a lead under 32, at least one aligned word, a tail under 32,
    adding up to the run (the shortest streamed runs leave the least room)."""
    import kvhost_cpu.kernels as kernels

    for nbytes in range(kernels.STREAM_RUN, 256):
        for dst in range(4096, 4096 + 32):
            lead, body = kernels._aligned_body(dst, nbytes)
            assert 0 <= lead < 32 and body >= 32 and (dst + lead) % 32 == 0 and body % 32 == 0
            assert 0 <= nbytes - lead - body < 32


def test_the_walk_applies_to_the_runs_the_kernels_stream():
    import kvhost_cpu.kernels as kernels
    from kvhost_cpu.backend import REORDER_MIN_RUN

    assert REORDER_MIN_RUN == kernels.STREAM_RUN


@pytest.mark.parametrize(
    ("dst", "nbytes", "lead", "body"),
    [
        (4096, 256, 0, 256),  # aligned: no lead, no tail
        (4096, 300, 0, 288),  # a tail of 12
        (4097, 300, 31, 256),  # a lead of 31 up to the boundary, a tail of 13
        (4127, 256, 1, 224),
        (4100, 1000, 28, 960),
    ],
)
def test_a_streamed_run_is_a_lead_to_the_32_byte_boundary_whole_words_and_a_tail(dst, nbytes, lead, body):
    import kvhost_cpu.kernels as kernels

    assert kernels._aligned_body(dst, nbytes) == (lead, body)
    assert (dst + lead) % 32 == 0 and body % 32 == 0 and 0 <= nbytes - lead - body < 32


def test_a_receive_scratch_copy_lies_2_kib_off_its_region_modulo_4_kib():
    # Any place in the row's first 4 KiB gives the same bytes; this one keeps a load from
    # the region and a store to the scratch from looking alike to the CPU (4K aliasing).
    import kvhost_cpu.kernels as kernels

    for start in (1 << 20, (1 << 20) + 1, (1 << 20) + 2047, (1 << 20) + 4095):
        for address in (0, 1, 2048, 4095, 4096, 12345, (1 << 30) + 77):
            base = kernels._skewed(start, address)
            assert start <= base < start + 4096
            assert (base - address) % 4096 == 2048


# --- how the parallel kernels share their work ----------------------------------------------
# Shares that overlap copy some blocks twice, to the same bytes: only these checks see it.


@pytest.mark.parametrize("items", [0, 1, 2, 3, 7, 8, 9, 100])
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 16])
def test_parallel_kernels_cut_their_items_into_disjoint_consecutive_shares(items, threads):
    import kvhost_cpu.kernels as kernels

    workers = kernels._workers(items, threads)
    assert workers == max(1, min(threads, items))
    shares = [kernels._share(items, workers, t) for t in range(workers)]
    assert [i for first, last in shares for i in range(first, last)] == list(range(items))  # each item once, in order
    assert max(last - first for first, last in shares) == -(-items // workers)  # as even as whole items allow


def test_padding_makes_loop_dims_of_size_1_and_stride_0():
    import kvhost_cpu.kernels as kernels

    from kvhost.transform import MAX_LOOP_DIMS, Loops

    padded = kernels._padded(Loops((3, 5), (40, 8), (16, 4), 8))
    pad = MAX_LOOP_DIMS - 2
    assert padded == [1] * pad + [3, 5] + [0] * pad + [40, 8] + [0] * pad + [16, 4]


@pytest.mark.parametrize("name", ["cpu", "torch"])
def test_a_backend_writes_and_reads_a_tensors_bytes_as_integers(name):
    backend = kvhost.get_backend("cpu", name=name)
    tensor = torch.zeros(3, 4, dtype=torch.bfloat16)
    values = torch.arange(12, dtype=torch.int16).reshape(3, 4) * 257
    backend.write_raw(tensor, values)
    assert backend.raw(tensor).dtype == torch.int16 and torch.equal(backend.raw(tensor), values)
    assert torch.equal(tensor.view(torch.int16), values)  # the tensor's own bytes changed


def test_optional_kernels_say_why_they_are_missing_or_refused():
    missing = OptionalKernels("kvhost_no_such_kernels")
    assert missing.module is None and "No module named 'kvhost_no_such_kernels'" in missing.reason
    refused = OptionalKernels("json", check=lambda module: f"{module.__name__} targets another device")
    assert refused.module is None and refused.reason == "json targets another device"
    accepted = OptionalKernels("json", check=lambda module: None)
    assert accepted.module is not None and accepted.module.__name__ == "json" and accepted.reason == ""
    assert OptionalKernels("json").module is not None


def test_kernels_whose_import_fails_otherwise_are_missing_for_good_with_the_reason(tmp_path, monkeypatch):
    """numba's llvmlite failing to map its library (an OSError, under a memory limit) left
    numba half imported: the first call said why, every later one raised AttributeError."""
    (tmp_path / "kvhost_unloadable_kernels.py").write_text(
        "imports = []\nimports.append(1)\nraise OSError('cannot map libllvmlite.so')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = OptionalKernels("kvhost_unloadable_kernels")
    assert kernels.module is None and kernels.reason == "OSError: cannot map libllvmlite.so"
    assert kernels.module is None and kernels.reason == "OSError: cannot map libllvmlite.so"  # kept, not retried


def test_without_numba_the_cpu_backend_s_check_makes_the_torch_path_s_scratch(monkeypatch):
    """The torch path reserves its scratch in its check: the CPU backend without kernels asks
    it, so that no room for it refuses the call before any job runs."""
    import kvhost_cpu.backend as cpu

    from kvhost.batch import plan_receive_batch
    from kvhost.caches import CacheSet

    monkeypatch.setattr(cpu, "KERNELS", OptionalKernels("kvhost_cpu.no_such_kernels"))
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    job = plan_receive_batch(CacheSet(caches, "KBNHC"), {"r": kvhost.Incoming([2, 5], "HNC", 2)}, None, None).jobs[0]
    cpu.CpuBackend().check_receive(job)
    assert list(job.shared) == [("torch receive", torch.device("cpu"), torch.uint8)]
