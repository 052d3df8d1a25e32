"""The XPU backend: Intel GPUs through torch's native ``torch.xpu`` (PyTorch >= 2.5).

The same code as CUDA (``kvhost_accelerator``: device-generic streams, events and
pinned memory, Triton kernels through Intel's Triton backend); only the device's name
differs. Before torch 2.5, torch had no native XPU device and intel-extension-for-pytorch
provided it, so only there is that package imported, and only when it is installed.

The barrier. Intel's Triton lowers ``tl.debug_barrier`` to OpenCL's ``barrier(flags)``
(SPIR-V ``OpControlBarrier``, work-group scope). Through its 3.7.0 release the flags are
``CLK_LOCAL_MEM_FENCE`` alone: the barrier orders work-group local memory, not global
memory, so words one thread stores to (or loads from) global memory before it need not
be visible to (or safe from) another thread after it. From 3.7.1 (LLVM's GPU-to-SPIR-V
lowering of ``gpu.barrier`` without address spaces changed to local | global) it fences
both. Seen in the compiled code: our receive kernel built for ``xpu`` with triton-xpu
3.3.0b1 calls ``_Z7barrierj(i32 1)``; Intel's own lowering tests read 1 up to v3.7.0 and
3 from v3.7.1. So with an older Intel Triton every receive takes the split mode (the
barrier is a kernel boundary), and with 3.7.1 or later the in-kernel modes.
``tests/test_triton_compile.py`` compiles for the XPU target wherever Intel's Triton is
installed (``ci/xpu.sh``) and checks the flag against this rule.
"""

from __future__ import annotations

import importlib.util
import itertools

import torch
from kvhost_accelerator import AcceleratorBackend

NATIVE_XPU = (2, 5)  # first torch release with torch.xpu built in
GLOBAL_BARRIER = (3, 7, 1)  # first Intel Triton whose tl.debug_barrier fences global memory


class XpuBackend(AcceleratorBackend):
    name = "xpu"
    device_types = ("xpu",)

    def triton_compilers(self) -> tuple[str, ...]:
        return ("intel",)

    def barrier_orders_global_memory(self) -> bool:
        """Intel's Triton fences global memory at ``tl.debug_barrier`` from 3.7.1 on (module docstring)."""
        import triton

        return release(triton.__version__) >= GLOBAL_BARRIER

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not _native_xpu():
            load_ipex_if_needed()
        xpu = getattr(torch, "xpu", None)
        return None if xpu is not None and xpu.is_available() else "no XPU device"


def release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as ``3.3.0b1`` or ``3.7.1+git1234``."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits or 0))
    return tuple(numbers)


def _native_xpu() -> bool:
    return release(torch.__version__)[:2] >= NATIVE_XPU


def load_ipex_if_needed() -> bool:
    """Import intel-extension-for-pytorch on torch < 2.5 (which it gives an XPU device); True if imported."""
    if _native_xpu() or importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return False
    import intel_extension_for_pytorch  # noqa: F401

    return True
