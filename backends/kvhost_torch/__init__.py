"""kvhost's torch backend: torch ops on any device, the reference every other backend is
checked against and the path they hand work to where their kernels cannot run."""

from kvhost_torch.backend import TorchBackend

__all__ = ["TorchBackend"]
