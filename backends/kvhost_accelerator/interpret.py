"""The accelerator backend on CPU tensors, its Triton kernels run by Triton's interpreter.

For tests only: it is not registered as an entry point; tests pass an instance as
``backend=`` (the API accepts a Backend instance). The code is the CUDA/XPU code
(``AcceleratorBackend``) with the CPU standing in for the device: streams and events are
no-ops (``SynchronousRuntime``) and every copy between two tensors takes the kernel path
(no direct ``copy_`` runs), so the conformance suite checks the kernels themselves.

Needs ``TRITON_INTERPRET=1`` in the environment before triton is first imported.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from functools import cached_property
from typing import ClassVar

from kvhost.backend import Completion
from kvhost.batch import CopyJob, ReceiveJob
from kvhost_accelerator.backend import AcceleratorBackend, load_kernels, unloaded_reason
from kvhost_accelerator.launch import Limits
from kvhost_accelerator.runtime import DeviceRuntime, SynchronousRuntime

INTERPRET_VARIABLE = "TRITON_INTERPRET"
# The interpreter patches triton.language for the length of a launch: one launch at a time.
_INTERPRETER = threading.Lock()


class TritonInterpretBackend(AcceleratorBackend):
    """``AcceleratorBackend`` on the CPU through Triton's interpreter.

    ``limits`` picks the kernels' register and scratch modes (small tiles exercise the
    tiled loops).
    """

    name = "triton-interpret"
    device_types = ("cpu",)
    priority = -1000
    max_run_copies = 0
    limits: ClassVar[Limits] = Limits(register_bytes=4 << 10, tile_bytes=2 << 10, programs=4)

    def __init__(self, limits: Limits | None = None) -> None:
        super().__init__()
        if limits is not None:
            self.limits = limits  # type: ignore[misc]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if os.environ.get(INTERPRET_VARIABLE, "0") in ("", "0"):
            return f"{INTERPRET_VARIABLE}=1 is not set (ci/cpu.sh sets it for the Triton tests)"
        return None

    def triton_compilers(self) -> tuple[str, ...]:
        return ()

    @cached_property
    def runtime(self) -> DeviceRuntime:
        return SynchronousRuntime()

    @cached_property
    def kernels_missing(self) -> str:
        kernels = load_kernels()
        if kernels is None:
            return unloaded_reason()
        if not kernels.interpreted():
            return f"kvhost_accelerator.kernels was imported without {INTERPRET_VARIABLE}=1: compiled for a GPU"
        return ""

    def describe(self) -> str:
        kernels = self.kernels
        path = "Triton kernels in the interpreter" if kernels is not None else f"torch ops ({self.kernels_missing})"
        return f"tests only, CPU tensors: {path}"

    def receive(self, job: ReceiveJob) -> None:
        with _INTERPRETER:
            super().receive(job)

    def copy(self, job: CopyJob) -> Completion:
        with _INTERPRETER:
            return super().copy(job)
