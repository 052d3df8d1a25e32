"""What CUDA (and ROCm) and XPU share: one backend class over torch's device-generic calls,
Triton kernels with their launch plans, and the interpreter stand-in that tests them on CPU.

``kvhost_cuda`` and ``kvhost_xpu`` each name their device and Triton target on top of it;
neither depends on the other. Importing this package imports neither triton nor a device.
"""

from kvhost.backend import EventCompletion
from kvhost_accelerator.backend import AcceleratorBackend

__all__ = ["AcceleratorBackend", "EventCompletion"]
