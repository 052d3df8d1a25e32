"""The prefill process: fill a KV cache, expose it with NIXL, hand decode its table, and wait.

Decode starts it (``python -m kvhost_tools.demo`` with decode's options, ``--role prefill``
and the control port) and writes a secret on its stdin; prefill proves the secret, says
hello (``kvhost.nixl.handshake``) and holds its registered memory until decode is done.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time
from typing import Any

import numpy as np

from kvhost.caches import CacheSet
from kvhost.errors import KVHostError
from kvhost.nixl import Agent, ProtocolError, RemoteRequest, prove, send_hello
from kvhost.nixl.handshake import SECRET_BYTES, wait_done
from kvhost.testing import raw
from kvhost_tools.demo.config import AXES, EXIT_ERROR, EXIT_OK, Config, DemoError, blocks_for, memory_options, pool_for
from kvhost_tools.demo.values import token_values, write_tokens


def main(config: Config) -> int:
    """Prefill, with its failures said in one line on stderr (exit 2)."""
    try:
        return run_prefill(config)
    except (KVHostError, OSError) as err:  # OSError: decode's socket was gone
        print(f"prefill: {type(err).__name__}: {err}", file=sys.stderr)
    except MemoryError:
        print(f"prefill: out of memory: {memory_options(config)}", file=sys.stderr)
    except RuntimeError as err:
        if "allocate" not in str(err):
            raise
        print(f"prefill: out of memory: {memory_options(config)}: {str(err).splitlines()[0]}", file=sys.stderr)
    return EXIT_ERROR


def run_prefill(config: Config) -> int:
    """Fill the cache, register it, prove who it is and send the hello, then hold the memory
    until decode is done."""
    secret = read_secret(sys.stdin.buffer, config.connect_timeout)
    block_size = config.prefill_block_size
    lengths = config.lengths()
    needed = [blocks_for(t, block_size) for t in lengths]
    pool = pool_for(needed)
    free = np.random.default_rng([config.seed, 2]).permutation(pool).tolist()
    caches = config.caches(config.prefill_layout, pool, block_size)
    started = time.perf_counter()
    cache_set = CacheSet(caches, AXES)
    for member in cache_set.members:
        raw(member.tensor).zero_()
    requests = []
    for number, (tokens, count) in enumerate(zip(lengths, needed)):
        ids, free = free[:count], free[count:]
        requests.append(RemoteRequest(f"req-{number:03d}", number, tokens, ids))
        for layer, member in enumerate(cache_set.members):
            values = token_values(
                config.seed, number, layer, tokens, config.heads, config.head_dim, member.layout.itemsize
            )
            write_tokens(member.tensor, AXES, ids, values)
    fill_seconds = time.perf_counter() - started

    with Agent(f"prefill-{os.getpid()}") as agent:
        table = agent.register(caches, AXES)
        with socket.create_connection(("127.0.0.1", config.port), timeout=config.connect_timeout) as sock:
            prove(sock, secret, timeout=config.connect_timeout)
            extra = {"fill_seconds": fill_seconds}
            send_hello(
                sock, table, requests, agent.metadata(), pid=os.getpid(), timeout=config.connect_timeout, extra=extra
            )
            # The memory must stay registered until decode has read it all.
            try:
                wait_done(sock, timeout=config.hold_timeout)
            except ProtocolError as err:
                print(f"prefill: decode went away: {err}", file=sys.stderr)
                return EXIT_ERROR
    return EXIT_OK


def read_secret(stream: Any, timeout: float) -> bytes:
    """The secret decode writes on prefill's stdin (hex, one line), within ``timeout`` seconds.

    Not argv, not the environment: any local user can read a process's command line in /proc.
    """
    ready, _, _ = select.select([stream], [], [], timeout)
    line = stream.readline(200) if ready else b""
    try:
        secret = bytes.fromhex(line.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise DemoError("no secret on stdin within the connect timeout: prefill is started by kvhost demo")
    return secret
