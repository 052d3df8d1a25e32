"""kvhost's CPU backend: compiled kernels (numba) where installed, torch ops where not."""

from kvhost_cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
