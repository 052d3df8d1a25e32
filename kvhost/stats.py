"""What a call did, in numbers: returned by receive and copy_blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhost.backend import Completion


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
    """One copy_blocks call; ``wait()`` returns once the bytes are in place."""

    blocks: int
    bytes_moved: int
    runs: int  # runs of consecutive ids on both sides
    backend: str
    completion: Completion = field(default_factory=Completion, repr=False, compare=False)

    def done(self) -> bool:
        return self.completion.done()

    def wait(self) -> CopyResult:
        self.completion.wait()
        return self
