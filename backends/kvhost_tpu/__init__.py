"""kvhost's TPU backend: torch_xla tensors (device type ``xla``), one compiled graph per job."""

from kvhost_tpu.backend import TpuBackend, block_dim, write_dtype

__all__ = ["TpuBackend", "block_dim", "write_dtype"]
