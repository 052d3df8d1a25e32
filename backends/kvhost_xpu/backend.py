"""The XPU backend: Intel GPUs through torch's native ``torch.xpu`` (PyTorch >= 2.5).

The same code as CUDA (``kvhost_accelerator``: device-generic streams, events and
pinned memory, Triton kernels through Intel's Triton backend); only the device's name
differs. Before torch 2.5, torch had no native XPU device and intel-extension-for-pytorch
provided it, so only there is that package imported, and only when it is installed.
"""

from __future__ import annotations

import importlib.util

import torch
from kvhost_accelerator import AcceleratorBackend

NATIVE_XPU = (2, 5)  # first torch release with torch.xpu built in


class XpuBackend(AcceleratorBackend):
    name = "xpu"
    device_types = ("xpu",)

    def triton_compilers(self) -> tuple[str, ...]:
        return ("intel",)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not _native_xpu():
            load_ipex_if_needed()
        xpu = getattr(torch, "xpu", None)
        return None if xpu is not None and xpu.is_available() else "no XPU device"


def _native_xpu() -> bool:
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= NATIVE_XPU


def load_ipex_if_needed() -> bool:
    """Import intel-extension-for-pytorch on torch < 2.5 (which it gives an XPU device); True if imported."""
    if _native_xpu() or importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return False
    import intel_extension_for_pytorch  # noqa: F401

    return True
