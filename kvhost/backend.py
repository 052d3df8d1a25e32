"""The backend contract: what a device supplies to kvhost.

A backend is a class registered in the ``kvhost.backends`` entry-point group. It names the
torch device types it serves and a priority (highest usable wins), says whether it can run
here, and does three things with validated work from the front end, one job per group:
rearrange blocks in place (``receive``), copy blocks (``copy``) and zero the tokens a
partial block did not receive (``zero``). It knows nothing of
requests. It also answers for its device the facts the core and the conformance oracle
must not guess from a device's name: how a tensor's bytes are read and written (``raw``,
``write_raw``; a view on most devices, a bitcast on XLA).

A backend package has a fixed shape (docs/design.md, "Backends"): ``backend.py`` holds
the class, ``__init__.py`` exports it, and nothing imports the device stack until the
backend is first used, so that importing kvhost stays light.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from kvhost.errors import ArgumentError, failure, shown
from kvhost.raw import as_raw

if TYPE_CHECKING:
    from kvhost.batch import CopyJob, ReceiveJob, ZeroJob
    from kvhost.layout import Layout


class Completion:
    """Completion of a copy. This one is already complete; async backends subclass it."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Event(Protocol):
    """What a completion asks of a device event (``torch.Event`` and the device modules' own)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class EventCompletion(Completion):
    """Done once the device has passed ``event`` and ``finish`` (host work after it) has run.

    ``keep`` holds the buffers the device still reads or writes until then: the caller's
    tensors, staging and bounce buffers, id tables. A handle dropped before it was seen
    done completes itself first (waits for the event, runs ``finish``) and warns with a
    ``ResourceWarning``: nothing it keeps is released while a stream still uses it, and a
    staged save still lands.
    """

    def __init__(self, event: Event, keep: Sequence[Any] = (), finish: Callable[[], None] | None = None) -> None:
        self.event = event
        self.keep = list(keep)
        self.finish = finish
        self._finished = False
        self._lock = threading.Lock()

    def __del__(self) -> None:
        if getattr(self, "_finished", True):
            return
        warnings.warn(
            "a non-blocking kvhost copy was dropped before done() or wait() saw it complete; waiting for it now "
            "(keep the CopyResult until then)",
            ResourceWarning,
            stacklevel=2,
        )
        self.wait()

    def done(self) -> bool:
        if self._finished:
            return True
        if not self.event.query():
            return False
        self._complete()
        return True

    def wait(self) -> None:
        if not self._finished:
            self.event.synchronize()
            self._complete()

    def _complete(self) -> None:
        with self._lock:
            if self._finished:
                return
            if self.finish is not None:
                self.finish()
            # ``finish`` may hold buffers too (a pinned bounce buffer the size of the batch):
            # a result kept after its copy completed must not keep them.
            self.keep, self.finish = [], None
            self._finished = True


def check_sizes(**options: object) -> None:
    """Size options and bounds (bytes, counts): each a non-negative int (a bool, a float or
    NaN is none); an ArgumentError names the first that is not."""
    for name, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArgumentError(f"{name} must be a non-negative integer, got {shown(value)}")


class Backend(ABC):
    """Base class of every backend: set the class variables, implement ``receive`` and ``copy``."""

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

    @abstractmethod
    def receive(self, job: ReceiveJob) -> None:
        """Rearrange, in place, every unit of ``job`` in every member tensor."""

    def check_receive(self, job: ReceiveJob) -> None:
        """Refuse (raise a KVHostError) a job this backend cannot do. Called for every job of a
        batch before any runs, so that a refusal known in advance leaves nothing written
        (the place, too, to make what a launch needs: a device without room for it is a
        refusal then, not a failure after earlier jobs ran); by default every job can be done."""
        return None

    @abstractmethod
    def copy(self, job: CopyJob) -> Completion:
        """Copy every block pair of ``job``; complete on return unless ``job.non_blocking``."""

    def check_copy(self, job: CopyJob) -> None:
        """Refuse (raise a KVHostError) a copy job this backend cannot do: ``check_receive``'s
        counterpart, called for every job of a copy before any runs; by default every job
        can be done."""
        return None

    def zero(self, job: ZeroJob) -> None:
        """Zero, in place, the tokens ``job`` names in every member tensor; runs after the
        batch's ``receive`` jobs.

        Torch ops on a view in memory order, of the tensor's bytes (zero is all-zero bytes
        in every KV dtype, and integers of each item size have index ops where fp8 and
        uint16 may not; no autograd), so it runs on any device; a backend may do it its way.
        """
        zeros = ZeroIndices.of(job)
        for member in job.members:
            zeros.apply(as_raw(member.tensor.detach()), job.layout)

    def exclusive(self) -> AbstractContextManager[object]:
        """Held around every call this backend does the work of, from the first read of a
        tensor's facts (registering, checking the caches are in place) to the end: a backend
        whose device cannot read them while another thread updates a tensor (torch_xla)
        returns its lock, one that keeps a scratch for the call's jobs (the CPU and
        accelerator backends) the scratch's scope; by default nothing is held."""
        return nullcontext()

    # --- facts about the device's tensors --------------------------------------------------

    def raw(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's bytes as integers of its item size, same shape (a view where the device has one)."""
        return as_raw(tensor)

    def write_raw(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (host integers of the tensor's item size and shape) into its bytes."""
        self.raw(tensor).copy_(values.to(tensor.device))

    def __repr__(self) -> str:
        return f"<kvhost backend {self.name!r} for {', '.join(self.device_types)}>"


def next_power_of_two(count: int) -> int:
    """The smallest power of two that holds ``count`` (1 for 0): sizes for grids, buckets
    and grow-only buffers, so that a few shapes serve every count."""
    return 1 << max(count - 1, 0).bit_length()


@dataclass(frozen=True)
class ZeroIndices:
    """A ``ZeroJob``'s block ids on its device: whole blocks, and blocks zeroed from a token on."""

    whole: torch.Tensor | None
    partial: list[tuple[int, torch.Tensor]]  # (first token zeroed, block ids)

    @classmethod
    def of(cls, job: ZeroJob) -> ZeroIndices:
        whole = torch.from_numpy(job.whole_ids).to(job.device) if job.whole_ids.size else None
        cuts = [(int(f), job.partial_ids[job.partial_from == f]) for f in np.unique(job.partial_from)]
        return cls(whole, [(f, torch.from_numpy(ids).to(job.device)) for f, ids in cuts])

    def apply(self, tensor: torch.Tensor, layout: Layout) -> None:
        """Zero the named tokens of ``tensor`` (a cache of ``layout``, or its bytes), in place."""
        b = len(layout.outer)  # the block dim of the view
        n = b + 1 + layout.region.index("N")  # the token dim
        view = layout.physical_view(tensor)
        if self.whole is not None:
            view.index_fill_(b, self.whole, 0)
        for first, ids in self.partial:
            view.narrow(n, first, layout.block_size - first).index_fill_(b, ids, 0)


class OptionalKernels:
    """A backend's compiled kernels, imported on first use, or why they cannot be.

    ``module`` is None when the import (or ``check``, which may name a further reason,
    such as a compiler that targets another device) fails; ``reason`` then says why, and
    the backend runs its torch path instead.
    """

    def __init__(self, module_name: str, check: Callable[[ModuleType], str | None] | None = None) -> None:
        self.module_name = module_name
        self._check = check

    @cached_property
    def _loaded(self) -> tuple[ModuleType | None, str]:
        try:
            module = importlib.import_module(self.module_name)
        except ImportError as err:
            return None, f"{err}"
        except Exception as err:  # a compiler's library that cannot load (no memory to map it): said, and kept
            return None, failure(err)
        why = self._check(module) if self._check is not None else None
        return (None, why) if why else (module, "")

    @property
    def module(self) -> ModuleType | None:
        return self._loaded[0]

    @property
    def reason(self) -> str:
        return self._loaded[1]
