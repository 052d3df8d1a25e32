"""Streams, events, device guards and pinned host memory for one accelerator type.

CUDA (and ROCm, which torch also calls ``cuda``) and XPU share this one implementation,
written against torch's device-generic calls: ``torch.accelerator`` (torch >= 2.6),
``torch.Stream`` and ``torch.Event``, ``pin_memory``. On an older stack (torch 2.5 with
native XPU) the same few calls go through the device module (``torch.xpu``), which has
the same names. That choice is the only branch; nothing else here knows the device.

``SynchronousRuntime`` stands in on the CPU, where the Triton kernels run in Triton's
interpreter for tests: there work is finished when it is issued, so streams are no-ops
and events are complete at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kvhost.backend import Event


class DeviceRuntime:
    """Device-generic stream and event calls for one torch device type (``cuda`` or ``xpu``)."""

    def __init__(self, device_type: str) -> None:
        self.module: Any = torch.get_device_module(device_type)
        accelerator = getattr(torch, "accelerator", None)
        # torch.accelerator.set_stream arrived in torch 2.6; before it, the device module's calls.
        self.generic = accelerator is not None and hasattr(accelerator, "set_stream") and hasattr(torch, "Event")
        self._side: dict[int, Any] = {}
        self._lock = threading.Lock()

    # --- streams -------------------------------------------------------------------------

    def current_stream(self, device: torch.device) -> Any:
        if self.generic:
            return torch.accelerator.current_stream(device)
        return self.module.current_stream(device)

    def side_stream(self, device: torch.device) -> Any:
        """The copy stream of ``device``, made on first use and kept. torch hands out streams
        round-robin from a pool (32 per device), so another component's may be the same
        one: ordering holds either way (waiting for itself is nothing), overlap may not."""
        index = self.index(device)
        with self._lock:
            if index not in self._side:
                self._side[index] = torch.Stream(device=device) if self.generic else self.module.Stream(device)
            return self._side[index]

    @contextlib.contextmanager
    def using(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` current on its device for the block (kernels and copies go there)."""
        if not self.generic:
            with self.module.stream(stream):
                yield
            return
        previous = torch.accelerator.current_stream(stream.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def capturing(self) -> bool:
        """Whether the current stream is capturing a graph (CUDA graphs; a device module
        without them never does)."""
        query = getattr(self.module, "is_current_stream_capturing", None)
        return bool(query()) if query is not None else False

    def wait(self, waiter: Any, producer: Any) -> None:
        """``waiter`` runs nothing more until ``producer``'s work so far is done (no host wait)."""
        waiter.wait_stream(producer)

    def record(self, stream: Any) -> Event:
        event: Any = torch.Event(device=stream.device) if self.generic else self.module.Event()
        event.record(stream)
        return event  # type: ignore[no-any-return]

    # --- devices and memory --------------------------------------------------------------

    def index(self, device: torch.device) -> int:
        if device.index is not None:
            return device.index
        return int(self.module.current_device())  # torch.accelerator's name for it changed in 2.7

    def guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make ``device`` the current one, so that Triton launches there."""
        return self.module.device(self.index(device))  # type: ignore[no-any-return]

    def host_buffer(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (from torch's caching host allocator, so reuse is cheap)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    def processors(self, device: torch.device) -> int:
        """Streaming multiprocessors (CUDA), compute units (ROCm) or Xe cores (XPU): sizes the grid."""
        props = self.module.get_device_properties(self.index(device))
        for name in ("multi_processor_count", "gpu_subslice_count", "max_compute_units"):
            count = getattr(props, name, None)
            if count:
                return int(count)
        return 64


class _Finished:
    """An event for work that finished when it was issued."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SynchronousRuntime(DeviceRuntime):
    """The CPU stand-in: every operation is complete on return, memory is ordinary memory.

    It answers every call itself, so it holds none of a device runtime's state."""

    def __init__(self) -> None:
        pass

    def current_stream(self, device: torch.device) -> None:
        return None

    def side_stream(self, device: torch.device) -> None:
        return None

    @contextlib.contextmanager
    def using(self, stream: Any) -> Iterator[None]:
        yield

    def capturing(self) -> bool:
        return False

    def wait(self, waiter: Any, producer: Any) -> None:
        return None

    def record(self, stream: Any) -> Event:
        return _Finished()

    def index(self, device: torch.device) -> int:
        return 0

    def guard(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def host_buffer(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def processors(self, device: torch.device) -> int:
        return 4
