"""kvhost's CUDA backend (ROCm too: torch calls both ``cuda``)."""

from kvhost_cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
