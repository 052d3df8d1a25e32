"""What kvhost tells UCX before NIXL starts it: settings a reader's speed depends on, where
UCX's own choice would be slow, and only where UCX would read them.

UCX reads its environment when a NIXL agent starts its UCX backend, so these go into
``os.environ`` before that (``give_ucx_defaults``: ``kvhost.nixl.Agent`` calls it, and the
vLLM connector before vLLM starts its own agent); a variable the environment already names
is left as it is.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

# Settings an Agent gives UCX's CUDA transports unless the environment already names them
# (UCX reads them when the first agent starts its backend). NIXL reads with UCX's get; UCX
# leaves cuda_ipc's get off on a GPU without NVLink peers (a lone GPU, PCIe boards), and a
# read of device memory from another process of the same machine then goes as software
# over TCP loopback: on an H200, the demo's batch read at 0.37 GB/s that way and at
# 9.6-12 GB/s with cuda_ipc's get.
UCX_CUDA_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


# Settings an Agent gives UCX itself unless the environment names them. UCX takes SIGHUP
# for its own (UCX_DEBUG_SIGNO, SIGHUP by default) when a worker starts: a hang-up then no
# longer stops the process, and UCX logs at DEBUG level from then on, thousands of lines a
# hand-off. 0 leaves SIGHUP to the process (which the kvhost commands take as a stop).
UCX_DEFAULTS = {"UCX_DEBUG_SIGNO": "0"}


def ucx_defaults() -> dict[str, str]:
    """``UCX_DEFAULTS``, and ``UCX_CUDA_DEFAULTS`` where UCX would read them: its CUDA
    transports load only where the CUDA driver does (elsewhere UCX warns of every variable
    it did not use)."""
    return {**UCX_DEFAULTS, **(UCX_CUDA_DEFAULTS if _cuda_driver_loads() else {})}


def give_ucx_defaults() -> None:
    """Put ``ucx_defaults()`` in this process's environment where it names none of them:
    before a NIXL agent starts (kvhost's ``Agent``, vLLM's through kvhost's connector)."""
    for key, value in ucx_defaults().items():
        os.environ.setdefault(key, value)


@cache
def _cuda_driver_loads() -> bool:
    try:  # loading the library only: cuInit is not called, so a fork after this stays safe
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True
