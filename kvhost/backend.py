"""The backend contract: what a device supplies to kvhost.

A backend is a class registered in the ``kvhost.backends`` entry-point group. It names
the torch device types it serves, a priority (highest usable wins), and says whether it
can run here. It receives validated work from the front end, one job per group, and
knows nothing of requests. Its module must import no device stack at import time: that
happens on first use, so that importing kvhost stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvhost.batch import CopyJob, ReceiveJob


class Completion:
    """Completion of a copy. This one is already complete; async backends subclass it."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Backend:
    """Base class of every backend. Subclasses set the class variables and both methods."""

    name: ClassVar[str]
    device_types: ClassVar[tuple[str, ...]]  # torch.device.type values; "*" serves any
    priority: ClassVar[int] = 0

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can run here, else a short reason (``no XPU device``)."""
        return None

    @classmethod
    def serves(cls, device_type: str) -> bool:
        """Whether this backend serves tensors on devices of ``device_type``."""
        return device_type in cls.device_types or "*" in cls.device_types

    def describe(self) -> str:
        """A few words on how this backend does its work, for ``kvhost info``."""
        return ""

    def receive(self, job: ReceiveJob) -> None:
        """Rearrange, in place, every unit of ``job`` in every member tensor."""
        raise NotImplementedError

    def copy(self, job: CopyJob) -> Completion:
        """Copy every block pair of ``job``; complete on return unless ``job.non_blocking``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kvhost backend {self.name!r} for {', '.join(self.device_types)}>"
