"""What a call did, in numbers: returned by receive and copy_blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhost.backend import Completion
from kvhost.batch import CopyJob


@dataclass(frozen=True)
class ReceiveStats:
    """One receive call.

    ``blocks``: local block ids in the batch; ``skipped_blocks``: those whose transform is
    the identity (no byte copied); ``bytes_moved``: bytes rewritten in place; ``groups``:
    transform groups that had work (one backend call each per layout); ``zeroed_blocks``:
    blocks past a request's last token (``Incoming.tokens``), wholly or from a token on.
    """

    blocks: int
    bytes_moved: int
    groups: int
    backend: str
    requests: int = 0
    skipped_blocks: int = 0
    zeroed_blocks: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class CopyResult:
    """One copy_blocks call; ``wait()`` returns once the bytes are in place.

    ``runs``: runs of ids consecutive on both sides (those the copy found, or found on
    first read when its backend never needed them).
    """

    blocks: int
    bytes_moved: int
    backend: str
    completion: Completion = field(default_factory=Completion, repr=False, compare=False)
    job: CopyJob | None = field(default=None, repr=False, compare=False)

    @property
    def runs(self) -> int:
        return 0 if self.job is None else int(self.job.runs.shape[0])

    def done(self) -> bool:
        return self.completion.done()

    def wait(self) -> CopyResult:
        self.completion.wait()
        return self
