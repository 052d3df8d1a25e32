"""Demo kvhost backends, found through the ``kvhost.backends`` entry points of this package.

``DemoBackend`` serves CPU tensors and torch's ``meta`` device at priority 10, above
kvhost's own ``cpu`` (0) and ``torch`` (-100) backends, so auto-selection picks it for
both. It counts its calls, so a test can see that it ran, and does the work with kvhost's
device-generic torch path. ``AbsentDeviceBackend`` claims CPU tensors at priority 100
but says it cannot run here: selection passes over it and keeps its reason.
``RaisingCheckBackend`` (priority 50) fails its own availability check, which counts as
a reason too. ``NOT_A_BACKEND`` is what a wrong entry point might name.
"""

from __future__ import annotations

from typing import ClassVar

from kvhost_torch import TorchBackend

from kvhost.backend import Completion
from kvhost.batch import CopyJob, ReceiveJob


class DemoBackend(TorchBackend):
    name = "demo"
    device_types = ("cpu", "meta")
    priority = 10
    calls: ClassVar[dict[str, int]] = {"receive": 0, "copy": 0}

    def describe(self) -> str:
        return "torch ops, counting calls"

    def receive(self, job: ReceiveJob) -> None:
        DemoBackend.calls["receive"] += 1
        super().receive(job)

    def copy(self, job: CopyJob) -> Completion:
        DemoBackend.calls["copy"] += 1
        return super().copy(job)


class AbsentDeviceBackend(TorchBackend):
    name = "demo-absent"
    device_types = ("cpu",)
    priority = 100

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "the demo accelerator is not installed"


class RaisingCheckBackend(TorchBackend):
    name = "demo-raising"
    device_types = ("cpu",)
    priority = 50

    @classmethod
    def unavailable_reason(cls) -> str | None:
        raise RuntimeError("driver query failed")


NOT_A_BACKEND = "a string, not a Backend subclass"
