"""A tensor's bytes as integers of its item size: how kvhost moves KV data, untouched.

Bytes, not values: fp8 (whose index ops some devices lack) and NaN payloads pass through
unchanged when they move as same-size integers.
"""

from __future__ import annotations

import torch

RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type of ``dtype``'s item size."""
    return RAW_DTYPES[dtype.itemsize]


def as_raw(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory, same shape and strides, as integers of the same item size (a view)."""
    return tensor.view(raw_dtype(tensor.dtype))
