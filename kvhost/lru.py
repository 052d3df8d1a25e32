"""A small thread-safe cache with a size bound, for everything kvhost remembers across calls.

Keys come from callers' tensors and arguments, so every cache has a bound (least recently
used entries go first), and connectors call from several threads: every change holds a
lock, and a lookup takes none (it runs on every call), relying on the interpreter's lock
to make one dict read atomic; one thread's eviction never makes another's lookup fail.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

from kvhost.errors import ArgumentError

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``size`` entries; ``get`` refreshes an entry, ``put`` evicts the oldest beyond the bound."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ArgumentError(f"an LRU cache needs room for at least one entry, got {size}")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        # No lock on the way in: a dict read is atomic, and a refresh that loses a race
        # with an eviction only means the entry was the oldest.
        value = self._entries.get(key)
        if value is not None:
            try:  # noqa: SIM105 (contextlib.suppress costs microseconds on a cold call, and this runs on every one)
                self._entries.move_to_end(key)
            except KeyError:
                pass
        return value

    def put(self, key: K, value: V) -> V:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
