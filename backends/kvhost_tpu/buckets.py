"""Index padding for XLA: a few bucket sizes, so compiled graphs grow with log(batch), not per batch.

XLA compiles one graph per distinct set of shapes. An index tensor of every new length
would compile a new graph, so index lists are padded up to the next bucket: a power of
two, at least ``MIN_BUCKET``. Batches of 1 to n entries then need at most
``max(0, ceil(log2(n / MIN_BUCKET))) + 1`` graphs (``len(buckets_up_to(n))``).

Padding repeats the last real entry (the last row, for index pairs and groups). A
padded entry therefore reads the same blocks as that real entry and writes the same
destination blocks with the very same bytes: whichever of the duplicate writes lands
last, the block holds what the real entry wrote. No padding entry can name any other
block, so padding can never write a block outside the request, whatever order or
bounds policy the device's scatter uses.
"""

from __future__ import annotations

import numpy as np

from kvhost.backend import next_power_of_two

MIN_BUCKET = 16


def bucket_size(count: int, min_bucket: int = MIN_BUCKET) -> int:
    """The padded length for ``count`` entries: the next power of two, at least ``min_bucket``."""
    if count < 0:
        raise ValueError(f"entry count {count} must not be negative")
    if min_bucket < 1 or min_bucket & (min_bucket - 1):
        raise ValueError(f"min_bucket {min_bucket} must be a positive power of two")
    return max(min_bucket, next_power_of_two(count))


def buckets_up_to(count: int, min_bucket: int = MIN_BUCKET) -> list[int]:
    """Every bucket a batch of 1 to ``count`` entries can use: the graphs it may compile."""
    sizes = [min_bucket]
    while sizes[-1] < bucket_size(count, min_bucket):
        sizes.append(sizes[-1] * 2)
    return sizes


def pad_rows(rows: np.ndarray, length: int) -> np.ndarray:
    """``rows`` (along axis 0) padded to ``length`` by repeating its last row."""
    count = rows.shape[0]
    if count == 0:
        raise ValueError("cannot pad an empty index list: there is no entry to repeat")
    if length < count:
        raise ValueError(f"pad length {length} is shorter than the {count} rows given")
    if length == count:
        return rows
    return np.concatenate([rows, np.repeat(rows[-1:], length - count, axis=0)])
