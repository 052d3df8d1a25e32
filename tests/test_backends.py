"""The torch path and the CPU backend at the edges the conformance suite does not reach.

Index buffers for devices (checked on ``meta``, which has no data but real buffers), the
torch backend's knobs, units larger than its pass size, copies with more runs than it
copies one by one, and the CPU backend with and without its compiled kernels. Found by
mutation testing (ci/mutation.py).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kvhost
from kvhost.backend import OptionalKernels
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw, read_tokens
from kvhost.torch_backend import IndexBuffers, TorchBackend

SIZES = dict(K=2, B=8, N=8, H=2, C=4)
META = torch.device("meta")


# --- index buffers on a device ------------------------------------------------------------


def test_host_ids_are_used_in_place():
    ids = np.array([3, 1, 2], dtype=np.int64)
    index = IndexBuffers()(ids, torch.device("cpu"))
    assert index.data_ptr() == ids.ctypes.data and index.tolist() == [3, 1, 2]


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
    elsewhere: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: (buffers(np.arange(2), META), elsewhere.append(_buffer(buffers))))
    thread.start()
    thread.join()
    assert elsewhere[0] is not _buffer(buffers)  # each thread its own


# --- the torch backend ---------------------------------------------------------------------


def test_torch_backend_settings():
    default = TorchBackend()
    assert (default.host_chunk_bytes, default.device_chunk_bytes, default.max_run_copies) == (1 << 20, None, 64)
    tuned = TorchBackend(host_chunk_bytes=4096, device_chunk_bytes=8192, max_run_copies=2)
    assert (tuned.host_chunk_bytes, tuned.device_chunk_bytes, tuned.max_run_copies) == (4096, 8192, 2)


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
    before = raw(dst["l"]).clone()
    src_ids, dst_ids = [0, 1, 5, 3], [6, 7, 2, 0]  # three runs, more than max_run_copies
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=TorchBackend(max_run_copies=2))
    layout_src, layout_dst = kvhost.Layout.of(src["l"], "KBNHC"), kvhost.Layout.of(dst["l"], "KBNHC")
    assert torch.equal(read_tokens(dst["l"], layout_dst, dst_ids), read_tokens(src["l"], layout_src, src_ids))
    for block in (1, 3, 4, 5):
        assert torch.equal(raw(dst["l"])[:, block], before[:, block])


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
