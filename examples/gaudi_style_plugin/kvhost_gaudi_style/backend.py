"""The device backend: kvhost's device-generic torch path, serving ``hpu`` tensors.

Gaudi runs torch's index and copy ops on HPU tensors, so kvhost's torch path (gather,
permute, scatter per group; one ``copy_`` per run of blocks) is a complete first backend:
the plugin subclasses it and says which device it serves and when it can run. A tuned
kernel would override ``receive``/``copy`` later, without touching the engine. The same
code runs on CPU tensors, which is how the example's tests exercise it.
"""

from __future__ import annotations

import importlib.util

import torch
from kvhost_torch import TorchBackend


class GaudiStyleBackend(TorchBackend):
    name = "gaudi-style"
    device_types = ("hpu",)
    priority = 10  # above kvhost's generic torch backend (-100), which also serves any device

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # Checked without importing the device stack: kvhost stays light to import.
        if importlib.util.find_spec("habana_frameworks") is None:
            return "habana_frameworks is not installed"
        hpu = getattr(torch, "hpu", None)
        if hpu is None or not hpu.is_available():
            return "no HPU device"
        return None

    def describe(self) -> str:
        return "torch ops on HPU tensors"
