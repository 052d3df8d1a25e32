"""The TPU backend's pure-Python parts: bucket sizes, padding, availability. No torch_xla needed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from kvhost_tpu import TpuBackend, block_dim, xla
from kvhost_tpu.buckets import MIN_BUCKET, bucket_size, buckets_up_to, pad_rows

import kvhost
from kvhost.errors import LayoutError
from kvhost.layout import Layout
from kvhost.registry import Registry

KV_TYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize(
    ("count", "size"),
    [(0, 16), (1, 16), (15, 16), (16, 16), (17, 32), (32, 32), (33, 64), (1000, 1024), (1024, 1024), (1025, 2048)],
)
def test_bucket_is_the_next_power_of_two_from_the_floor(count, size):
    assert bucket_size(count) == size


def test_bucket_floor_is_configurable_and_checked():
    assert bucket_size(3, min_bucket=4) == 4 and bucket_size(5, min_bucket=4) == 8
    # A floor of 1 (2**0) leaves the bare powers of two, an empty batch included.
    assert [bucket_size(n, min_bucket=1) for n in range(6)] == [1, 1, 2, 4, 4, 8]
    for floor in (0, -2, 12):
        with pytest.raises(ValueError, match="power of two"):
            bucket_size(3, min_bucket=floor)
    with pytest.raises(ValueError, match="negative"):
        bucket_size(-1)


def test_buckets_grow_with_the_log_of_the_batch():
    assert buckets_up_to(16) == [16]
    assert buckets_up_to(200) == [16, 32, 64, 128, 256]
    # Every size from 1 to 4096 lands in one of log2(4096 / 16) + 1 = 9 buckets.
    used = {bucket_size(n) for n in range(1, 4097)}
    assert used == set(buckets_up_to(4096)) and len(used) == 9


def test_padding_repeats_the_last_row_only():
    ids = np.array([7, 3, 11])
    padded = pad_rows(ids, 16)
    assert padded.tolist() == [7, 3, 11] + [11] * 13
    groups = np.array([[4, 5], [0, 1]])  # units of g = 2 blocks: the whole last unit repeats
    assert pad_rows(groups, 4).tolist() == [[4, 5], [0, 1], [0, 1], [0, 1]]
    units = np.array([[4, 5], [0, 1], [8, 9]])  # rows counted along axis 0, not the unit's width
    assert pad_rows(units, 4).tolist() == [[4, 5], [0, 1], [8, 9], [8, 9]]
    assert pad_rows(ids, 3) is ids


def test_padding_names_no_block_outside_the_request():
    rng = np.random.default_rng(1)
    for count in range(1, 70):
        ids = rng.choice(1000, count, replace=False)
        padded = pad_rows(ids, bucket_size(count))
        assert set(padded.tolist()) == set(ids.tolist())
        assert padded.size == bucket_size(count) >= count


def test_padding_rejects_what_it_cannot_pad():
    with pytest.raises(ValueError, match="empty"):
        pad_rows(np.zeros(0, dtype=np.int64), 16)
    with pytest.raises(ValueError, match="shorter"):
        pad_rows(np.arange(20), 16)


def test_backend_contract():
    assert TpuBackend.name == "tpu" and TpuBackend.device_types == ("xla",)
    assert TpuBackend.min_bucket == MIN_BUCKET
    assert "powers of two from 16" in TpuBackend().describe()


def test_missing_torch_xla_is_named(monkeypatch):
    xla._load.cache_clear()
    monkeypatch.setattr(xla.importlib.util, "find_spec", lambda name: None)
    try:
        assert TpuBackend.unavailable_reason() == "torch_xla not installed"
        with pytest.raises(ImportError, match="torch_xla not installed"):
            xla.module()
    finally:
        xla._load.cache_clear()


def test_a_torch_xla_that_fails_to_import_is_named(monkeypatch):
    """A torch/torch_xla version mismatch: installed, but the import raises."""
    xla._load.cache_clear()
    monkeypatch.setattr(xla.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # `import torch_xla` now raises ImportError
    try:
        assert (
            TpuBackend.unavailable_reason()
            == "torch_xla failed to import: ModuleNotFoundError: import of torch_xla halted; None in sys.modules"
        )
        with pytest.raises(ImportError, match="torch_xla failed to import"):
            xla.module()
    finally:
        xla._load.cache_clear()


def test_write_types_by_device_kind(monkeypatch):
    """What each kind of XLA device scatters as it is; every other type goes through integers."""

    def native(kind: str) -> set[torch.dtype]:
        monkeypatch.setattr(xla, "hardware", lambda device: kind)
        return {dtype for dtype in KV_TYPES if xla.native_writes(torch.device("xla"), dtype)}

    integers = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    assert native("TPU") == integers | {torch.float32, torch.bfloat16}  # bf16 is a TPU type
    assert native("CPU") == integers | {torch.float32, torch.float64, torch.float16}  # measured: bf16, fp8 upcast
    assert native("GPU") == integers | {torch.float32}  # a kind not known: nothing any XLA compiler upcasts


def test_a_bitcast_needs_one_item_size():
    with pytest.raises(ValueError, match=r"cannot reinterpret torch\.int16 as torch\.int32: item sizes differ"):
        xla.bitcast(torch.zeros(2, dtype=torch.int16), torch.int32)
    same = torch.zeros(2, dtype=torch.int16)
    assert xla.bitcast(same, torch.int16) is same  # nothing to do: no op, no torch_xla


def test_registry_says_why_tpu_is_unavailable(monkeypatch):
    xla._load.cache_clear()
    monkeypatch.setattr(xla.importlib.util, "find_spec", lambda name: None)
    try:
        rows = {row.name: row for row in Registry().info()}
        assert rows["tpu"].device_types == ("xla",)
        assert rows["tpu"].unavailable == "torch_xla not installed"
        with pytest.raises(kvhost.KVHostError, match="backend 'tpu' cannot run here: torch_xla not installed"):
            Registry().instance("tpu")
    finally:
        xla._load.cache_clear()


def test_importing_the_backend_does_not_import_torch_xla():
    modules = "kvhost_tpu, kvhost_tpu.buckets, kvhost_tools.device_checks.xla_scaling"
    code = f"import sys, {modules}; print('torch_xla' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_block_dim_is_the_shape_position_of_b_and_refuses_a_strided_order():
    """XLA tensors are read in shape order; a layout whose memory order differs (a host
    tensor's permuted view) is named, not indexed by its shape position."""
    cache = torch.zeros(2, 6, 4, 3, 8)  # K B N H C
    assert block_dim(Layout.of(cache, "KBNHC")) == 1
    assert block_dim(Layout.of(cache.permute(1, 0, 2, 3, 4).contiguous(), "BKNHC")) == 0
    with pytest.raises(LayoutError, match="physical order 'KBNHC'"):
        block_dim(Layout.of(cache.permute(1, 0, 2, 3, 4), "BKNHC", name="view"))
    with pytest.raises(LayoutError, match=r"axes 'NBHC': N \(of size 1\) is named before B; an XLA tensor's memory"):
        block_dim(Layout.of(torch.zeros(1, 6, 2, 8), "NBHC"))  # dense, as XLA reports it: N steps over B
