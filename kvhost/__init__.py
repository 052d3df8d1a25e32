"""kvhost: the device layer that moves and reshapes KV-cache blocks for disaggregated serving.

Importing kvhost imports no device stack; backends load on first use of their device.
"""

from kvhost.api import KVHost, copy_blocks, receive
from kvhost.backend import Backend, Completion
from kvhost.batch import Incoming
from kvhost.errors import ArgumentError, BackendError, KVHostError, LayoutError, RequestError
from kvhost.layout import Layout
from kvhost.registry import get_backend
from kvhost.stats import CopyResult, ReceiveStats

__all__ = [
    "ArgumentError",
    "Backend",
    "BackendError",
    "Completion",
    "CopyResult",
    "Incoming",
    "KVHost",
    "KVHostError",
    "Layout",
    "LayoutError",
    "ReceiveStats",
    "RequestError",
    "copy_blocks",
    "get_backend",
    "receive",
]
__version__ = "0.1.0"
