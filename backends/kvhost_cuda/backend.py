"""The CUDA backend (ROCm too: torch calls both ``cuda``): Triton kernels, pinned staging, events.

Everything but the device's name and Triton target lives in
``kvhost_accelerator.AcceleratorBackend``, which the XPU backend shares. Importing this
package imports neither triton nor a CUDA context.
"""

from __future__ import annotations

import torch
from kvhost_accelerator import AcceleratorBackend


class CudaBackend(AcceleratorBackend):
    name = "cuda"
    device_types = ("cuda",)

    def triton_compilers(self) -> tuple[str, ...]:
        return ("amd",) if torch.version.hip else ("nvidia",)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if torch.cuda.is_available() else "no CUDA device"
