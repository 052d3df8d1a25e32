"""What a call did, in numbers: returned by receive and copy_blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from kvhost.backend import Completion
from kvhost.batch import find_runs


@dataclass(frozen=True)
class ReceiveStats:
    """One receive call.

    ``blocks``: local block ids in the batch; ``skipped_blocks``: those whose transform is
    the identity (no byte copied); ``bytes_moved``: bytes rewritten in place; ``groups``:
    transform groups that had work (one backend call each per layout).
    """

    blocks: int
    bytes_moved: int
    groups: int
    backend: str
    requests: int = 0
    skipped_blocks: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CopyResult:
    """One copy_blocks call; ``wait()`` returns once the bytes are in place.

    ``runs``: runs of ids consecutive on both sides (counted on first read).
    """

    blocks: int
    bytes_moved: int
    backend: str
    completion: Completion = field(default_factory=Completion, repr=False, compare=False)
    ids: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def runs(self) -> int:
        return 0 if self.ids is None or self.ids[0].size == 0 else int(find_runs(*self.ids).shape[0])

    def done(self) -> bool:
        return self.completion.done()

    def wait(self) -> CopyResult:
        self.completion.wait()
        return self
