"""``kvhost demo``: a prefill engine hands a batch of requests to a decode engine over real NIXL.

Two OS processes, each with its own NIXL agent over UCX on loopback (UCX_NET_DEVICES=lo
unless you set it). Decode (this process) listens on 127.0.0.1 only, starts prefill, hands it
a secret on its stdin, and receives its agent metadata, block table and requests over that
socket (``kvhost.nixl.handshake``); a connection that does not prove the secret first is
dropped. Prefill fills its KV cache with values that are a seeded function of (request,
layer, K/V, token, head, channel). Decode allocates blocks, pulls every request with NIXL
(``kvhost.nixl``), post-processes the whole batch in one ``kvhost.receive`` call, and
checks every token bit for bit against the same function.

``--via-host`` lands the bytes in a registered host buffer shaped like the decode cache
instead (the same descriptors), ``kvhost.copy_blocks`` loads them into the cache and
``kvhost.receive`` rearranges them there: the path of decode engines whose memory NIXL
cannot reach. ``--decode-ranks R`` splits decode into R ranks of heads/R heads, each
reading only its share of the sender's heads (heterogeneous tensor parallelism).
``--kill-prefill-after N`` kills prefill once N requests have arrived: decode reports the
requests that failed, post-processes and verifies only those that arrived whole, and
exits 1. ``--freeze-prefill-after N`` stops it (SIGSTOP) instead: where the transport
needs the peer to answer (UCX over TCP alone), the transfers hang and decode's
per-transfer timeout ends them.

Exit status: 0 when every request verified, 1 only when requests failed (did not arrive,
or did not verify), 2 for anything else (impossible options, a hand-off that could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import NoReturn

from kvhost.nixl import MAX_WAIT_SECONDS, InvalidTimeoutError, check_seconds
from kvhost.nixl.handshake import MAX_REQUESTS
from kvhost_tools.demo import prefill
from kvhost_tools.demo.config import DTYPES, EXIT_ERROR, LAYOUTS, Config, refusal
from kvhost_tools.demo.decode import run_decode

# Where the NIXL/UCX agents of both processes listen, unless the user set it: loopback.
LOOPBACK_UCX = {"UCX_NET_DEVICES": "lo"}


def main(argv: Sequence[str] | None = None) -> int:
    """``kvhost demo``: decode (which starts prefill), or prefill itself (``--role prefill``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = config_from(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        with loopback_ucx():
            if config.role == "prefill":
                return prefill.main(config)
            return run_decode(config, argv)
    except Exception:  # a bug: say where, but never exit 1, which means only that requests failed
        traceback.print_exc()
        return EXIT_ERROR


def config_from(argv: Sequence[str], *, check: bool = True) -> Config:
    """The options as a ``Config``; impossible ones (``check``) exit 2 with one line naming the option."""
    p = parser()
    args = p.parse_args(argv)
    config = Config(
        requests=args.requests,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=DTYPES[args.dtype],
        seed=args.seed,
        prefill_block_size=args.prefill_block_size,
        decode_block_size=args.decode_block_size,
        prefill_layout=args.prefill_layout,
        decode_layout=args.decode_layout,
        decode_ranks=args.decode_ranks,
        via_host=args.via_host,
        backend=args.backend,
        kill_prefill_after=args.kill_prefill_after,
        freeze_prefill_after=args.freeze_prefill_after,
        inflight=args.inflight,
        timeout=args.timeout,
        connect_timeout=args.connect_timeout,
        json_path=args.json,
        progress=not args.no_progress,
        role=args.role,
        port=args.port,
        hold_timeout=args.hold_timeout,
    )
    problem = refusal(config) if check else None
    if problem is not None:
        p.error(problem)
    return config


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr naming the option, and exit 2 (``--help`` lists the options)."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _seconds(text: str) -> float:
    """An option's seconds: a finite number above 0, at most a week (never NaN or infinite)."""
    try:
        return check_seconds(float(text), "", positive=True)
    except (ValueError, InvalidTimeoutError):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds in (0, {MAX_WAIT_SECONDS:g}], got {text!r}"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvhost demo", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--prefill-block-size", type=int, default=16, metavar="N", help="tokens per prefill block")
    p.add_argument("--decode-block-size", type=int, default=64, metavar="N", help="tokens per decode block")
    p.add_argument("--prefill-layout", choices=sorted(LAYOUTS), default="HND", help="prefill cache layout")
    p.add_argument("--decode-layout", choices=sorted(LAYOUTS), default="NHD", help="decode cache layout")
    p.add_argument("--layers", type=int, default=4, help="layers, each a [2, blocks, N, heads, head_dim] cache")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, help="channels per head")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="cache dtype")
    p.add_argument("--requests", type=int, default=40, help=f"requests in the batch (at most {MAX_REQUESTS})")
    p.add_argument("--min-tokens", type=int, default=16, help="shortest request")
    p.add_argument("--max-tokens", type=int, default=2048, help="longest request (lengths are log-uniform)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, block ids and values")
    p.add_argument("--backend", default=None, help="kvhost backend for the post-process (None: chosen by device)")
    p.add_argument("--via-host", action="store_true", help="land bytes in a host buffer, then copy_blocks")
    p.add_argument(
        "--decode-ranks",
        type=int,
        default=1,
        metavar="R",
        help="decode ranks per prefill rank (heterogeneous TP): each holds and reads heads/R heads",
    )
    faults = p.add_mutually_exclusive_group()
    faults.add_argument("--kill-prefill-after", type=int, metavar="N", help="kill prefill after N requests arrived")
    faults.add_argument("--freeze-prefill-after", type=int, metavar="N", help="stop prefill (SIGSTOP) after N arrived")
    p.add_argument("--inflight", type=int, default=8, help="transfers in flight at once")
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds one transfer may take")
    p.add_argument("--connect-timeout", type=_seconds, default=60.0, help="seconds for prefill to start and say hello")
    p.add_argument("--json", metavar="PATH", help="also write the outcome as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    # Set by decode when it starts prefill; not for people.
    p.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--hold-timeout", type=_seconds, default=600.0, help=argparse.SUPPRESS)
    return p


@contextlib.contextmanager
def loopback_ucx() -> Iterator[None]:
    """UCX of this process and the prefill it starts on loopback only (``LOOPBACK_UCX``),
    where the user did not say otherwise; the environment is restored afterwards."""
    added = [key for key in LOOPBACK_UCX if key not in os.environ]
    os.environ.update({key: LOOPBACK_UCX[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
