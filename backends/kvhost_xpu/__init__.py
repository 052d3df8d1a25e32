"""kvhost's XPU backend: Intel GPUs through torch's native ``torch.xpu``."""

from kvhost_xpu.backend import XpuBackend

__all__ = ["XpuBackend"]
