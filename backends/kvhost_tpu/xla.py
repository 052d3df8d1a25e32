"""The few torch_xla calls kvhost needs, imported on first use so that importing kvhost_tpu stays light.

torch_xla pins its own torch and takes seconds to import; nothing here touches it until
a function is called. ``missing()`` says why it cannot be used, without raising.

Bytes, not values: kvhost moves KV bytes untouched (NaN payloads included). XLA
compilers upcast the element types a device lacks (XLA:CPU runs bf16 and fp8 scatters
in f32/f16, rewriting NaN payloads and converting the whole operand), and torch_xla
moves fp16 to the host through f32. ``native_writes`` says which element types a
device scatters as they are; every other cache is written through a same-size integer
``bitcast`` (an XLA BitcastConvert inside the graph: torch's ``view(dtype)`` would fall
back to the host and copy the whole tensor), and anything leaving the device leaves
as integers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cache
from types import ModuleType
from typing import Any

import torch

from kvhost.errors import LayoutError
from kvhost.raw import raw_dtype as raw_dtype  # kvhost_tpu callers use xla.raw_dtype

INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})

# Element types each device kind scatters in place and bit for bit, by torch_xla's
# hardware name. CPU: measured (tests/test_tpu.py); bf16 and fp8 are upcast there.
# TPU: bf16 is a native TPU type; not measured here (no TPU). Unknown kinds: integers
# and f32 only, which no XLA backend upcasts.
NATIVE_WRITES: dict[str, frozenset[torch.dtype]] = {
    "CPU": INTEGER_DTYPES | {torch.float32, torch.float64, torch.float16},
    "TPU": INTEGER_DTYPES | {torch.float32, torch.bfloat16},
}
DEFAULT_NATIVE_WRITES = INTEGER_DTYPES | {torch.float32}

# XLA's names of element types, for BitcastConvert. Not bool: XLA's pred is a bit to
# BitcastConvert, so a bool block would change shape as bytes (and crashed the process).
_XLA_TYPE_NAMES = {
    torch.uint8: "u8",
    torch.uint16: "u16",
    torch.uint32: "u32",
    torch.uint64: "u64",
    torch.int8: "s8",
    torch.int16: "s16",
    torch.int32: "s32",
    torch.int64: "s64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float8_e4m3fn: "f8e4m3fn",
    torch.float8_e5m2: "f8e5m2",
}


@cache
def _load() -> ModuleType | str:
    """torch_xla itself, or why it cannot be imported."""
    if importlib.util.find_spec("torch_xla") is None:
        return "torch_xla not installed"
    try:
        import torch_xla
        import torch_xla.core.xla_model
        import torch_xla.debug.metrics  # compile counts
    except Exception as err:  # a torch/torch_xla version mismatch fails in many ways
        return f"torch_xla failed to import: {type(err).__name__}: {err}"
    loaded: ModuleType = torch_xla
    return loaded


def missing() -> str | None:
    """None when torch_xla can be used here, else a short reason."""
    loaded = _load()
    return loaded if isinstance(loaded, str) else None


def module() -> ModuleType:
    """torch_xla, imported; raises ImportError with the reason when it cannot be."""
    loaded = _load()
    if isinstance(loaded, str):
        raise ImportError(loaded)
    return loaded


def sync() -> None:
    """Compile (or reuse) and run everything pending as one graph: a step barrier.

    A step barrier is where torch_xla donates the buffers of tensors updated in place
    to the graph's outputs, so an indexed update rewrites the cache where it lies.
    """
    module().sync(wait=True)


def sync_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Compile (or reuse) and run what ``tensors`` are pending on, as one graph, and wait:
    a step barrier for them alone, on whichever device they lie.

    ``sync`` would take everything pending on the default device: an engine's lazy work
    pulled into kvhost's graph (a new graph to compile each time it differs, the engine's
    graph cut where kvhost's call came), and nothing of a cache on another device. Their
    buffers updated in place are donated to the graph's outputs as at a step barrier.
    """
    module()._XLAC._xla_sync_multi(list(tensors), devices=[], wait=True)


def wait() -> None:
    """Block until every graph dispatched so far has finished."""
    module().core.xla_model.wait_device_ops()


def compile_count() -> int:
    """Graphs compiled so far in this process (torch_xla's CompileTime samples)."""
    data = module().debug.metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0


def buffer_address(tensor: torch.Tensor) -> int:
    """Address of the device buffer holding ``tensor`` now (after a sync).

    If an update keeps this address, the cache was rewritten where it lies: torch_xla
    donated the buffer and no second cache-sized buffer took its place.
    """
    return int(module()._XLAC._unsafe_buffer_pointer(tensor))


@cache
def hardware(device: torch.device) -> str:
    """torch_xla's name for the kind of device behind ``device``: ``CPU``, ``TPU``, ``CUDA``..."""
    return str(module().core.xla_model.xla_device_hw(device))


def native_writes(device: torch.device, dtype: torch.dtype) -> bool:
    """True when ``device`` scatters ``dtype`` in place and bit for bit, as it is."""
    return dtype in NATIVE_WRITES.get(hardware(device), DEFAULT_NATIVE_WRITES)


@cache
def _bitcast_op() -> Any:
    import torch_xla.core.xla_op_registry as registry

    return registry.register("kvhost_bitcast", lambda x, to_type: x.bitcast(to_type))


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Refuse an element type XLA cannot bitcast to and from integers (complex: a pair of
    floats to XLA), before any byte moves."""
    if dtype not in _XLA_TYPE_NAMES:
        known = ", ".join(sorted(str(d).removeprefix("torch.") for d in _XLA_TYPE_NAMES))
        raise LayoutError(f"{what}: {dtype} has no XLA bitcast to integers; the TPU backend moves {known}")


def bitcast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor``'s bytes as ``dtype`` (same item size), an op inside the graph, not a host detour."""
    if tensor.dtype == dtype:
        return tensor
    if tensor.element_size() != dtype.itemsize:
        raise ValueError(f"cannot reinterpret {tensor.dtype} as {dtype}: item sizes differ")
    result: torch.Tensor = _bitcast_op()(tensor, to_type=_XLA_TYPE_NAMES[dtype])
    return result
