"""The options the three commands share (``kvhost demo``, ``kvhost prefill``, ``kvhost decode``), as typed values.

Impossible options end the command with status 2 and one line naming the option
(``Parser.error``). Like ``config``, nothing here imports kvhost or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections.abc import Sequence
from typing import NoReturn

from kvhost_tools.blocks import BLOCK_ID_KINDS, MAX_RUN
from kvhost_tools.demo.config import DTYPES, EXIT_ERROR, LAYOUTS, MAX_REQUESTS, EngineShape, Model, Share, Workload

MAX_WAIT_SECONDS = 7 * 24 * 3600.0  # as kvhost.nixl.fields says: every wait is finite
DEFAULT_PORT = 7600


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default (where it has one, and
    its help does not already say it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr naming the option, and exit 2 (``--help`` lists the options)."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def seconds(text: str) -> float:
    """An option's seconds: a finite number above 0, at most a week (never NaN or infinite)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_WAIT_SECONDS):
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, {MAX_WAIT_SECONDS:g}], got {text!r}")
    return value


def peer_timeout_refusal(seconds: float) -> str | None:
    """Why prefill's ``--peer-timeout`` cannot be kept (four of the shortest beats a decode
    is told to send must fit in it), or None."""
    from kvhost.nixl.peers import MIN_BEAT_SECONDS

    if seconds >= 4 * MIN_BEAT_SECONDS:
        return None
    return (
        f"--peer-timeout must be at least {4 * MIN_BEAT_SECONDS:g} s (four of the shortest beats, "
        f"{MIN_BEAT_SECONDS:g} s), got {seconds:g}"
    )


def backend_refusal(name: str, device: str = "cpu") -> str | None:
    """Why ``--backend name`` cannot serve ``device`` here (unknown, or unable to run), or None."""
    import torch

    import kvhost

    try:
        kvhost.get_backend(torch.device(device), name)
    except kvhost.KVHostError as err:
        return f"--backend {name!r}: {err}"
    return None


def share_refusal(workload: Workload, share: Share) -> str | None:
    """Why an engine with ``--share share`` would have nothing to do, or None."""
    if workload.numbers(share):
        return None
    return f"--share {share} holds none of --requests {workload.requests}"


def share(text: str) -> Share:
    """``I/N``: the requests whose number is I mod N."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 0 <= int(index) < int(count) <= MAX_REQUESTS):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N <= {MAX_REQUESTS}, got {text!r}")
    return Share(int(index), int(count))


def add_model(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("the model (every engine must give the same)")
    group.add_argument("--cache", choices=["mha", "mla"], default="mha", help="K/V per head, or one MLA latent")
    group.add_argument("--layers", type=int, default=4, help="layers")
    group.add_argument("--heads", type=int, default=8, help="KV heads of the model, shared out by each engine's ranks")
    group.add_argument("--head-dim", type=int, default=64, help="channels per head (mla: of the latent)")
    group.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="cache dtype")


def add_workload(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("the batch (every engine must give the same)")
    group.add_argument("--requests", type=int, default=40, help=f"requests in the batch (at most {MAX_REQUESTS})")
    group.add_argument("--min-tokens", type=int, default=16, help="shortest request")
    group.add_argument("--max-tokens", type=int, default=2048, help="longest request (lengths are log-uniform)")
    group.add_argument("--seed", type=int, default=0, help="seed of lengths, block ids and values")
    group.add_argument(
        "--block-ids",
        choices=BLOCK_ID_KINDS,
        default="runs",
        help="block ids as allocators hand them out (runs of consecutive blocks), or scattered",
    )
    group.add_argument(
        "--max-run",
        type=int,
        default=MAX_RUN,
        metavar="N",
        help=f"longest run of ids (default {MAX_RUN}; 1: fragmented)",
    )


def add_engine(p: argparse.ArgumentParser, layout: str, block_size: int) -> None:
    group = p.add_argument_group("this engine's cache")
    group.add_argument(
        "--layout", choices=sorted(LAYOUTS), default=None, help=f"cache layout (default {layout}; MLA with --cache mla)"
    )
    group.add_argument("--block-size", type=int, default=block_size, metavar="N", help="tokens per block")
    group.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel ranks, each its own NIXL agent")
    group.add_argument(
        "--cross-layer", action="store_true", help="one cache tensor, a block's layers back to back (vLLM's)"
    )
    group.add_argument("--share", type=share, default=Share(), metavar="I/N", help="take requests I mod N")


def add_network(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("network")
    group.add_argument(
        "--secret-file",
        required=True,
        metavar="PATH",
        help="the secret both engines prove (hex; mode 600; '-': one line on stdin); prefill creates it if missing",
    )
    group.add_argument(
        "--advertise",
        metavar="ADDR",
        help="the address whose interface NIXL/UCX uses (sets UCX_NET_DEVICES unless it is set)",
    )
    group.add_argument(
        "--connect-timeout",
        type=seconds,
        default=60.0,
        help="seconds to connect to a prefill engine (decode), and to read --secret-file - (both)",
    )


def json_path(text: str) -> str:
    """A file the outcome can be written to, checked before the run: one that may be written
    (``/dev/stdout`` too), or a new one in a folder that may be written."""
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file name")
    if os.path.exists(text):
        if not os.access(text, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} may not be written")
        if not os.path.isfile(text):  # /dev/stdout, a pipe: written as it is
            return text
    folder = os.path.dirname(os.path.realpath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: no folder {folder!r} to write it in")
    problem = folder_refusal(folder)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


def write_json_file(path: str, data: object) -> None:
    """``data`` as JSON at ``path``, whole or not at all where it is a file."""
    as_it_is = os.path.exists(path) and not os.path.isfile(path)  # /dev/stdout, a pipe
    target = os.path.realpath(path)  # a link's file is written, and the link kept
    written = path if as_it_is else f"{target}.partial"  # else whole or not at all: never half an outcome
    with open(written, "w") as out:
        json.dump(data, out, indent=1)
    if not as_it_is:
        os.replace(written, target)


def folder_refusal(folder: str) -> str | None:
    """Why no new file can be made in ``folder``, or None. A file is written beside itself,
    then renamed over (whole or not at all), so its folder must take one, which only trying
    tells (root may write anywhere, /proc aside)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvhost-"):
            pass
    except OSError as err:
        return f"cannot write in {folder!r}: {err.strerror or err}"
    return None


def add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=json_path, metavar="PATH", help="also write the outcome as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")


def model_of(args: argparse.Namespace) -> Model:
    heads = args.heads if args.cache == "mha" else 1
    return Model(args.cache, args.layers, heads, args.head_dim, args.dtype)


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(args.requests, args.min_tokens, args.max_tokens, args.seed, args.block_ids, args.max_run)


def default_layout(kind: str, given: str | None, default: str) -> str:
    return given or ("MLA" if kind == "mla" else default)


def shape_of(args: argparse.Namespace, default_layout_name: str) -> EngineShape:
    layout = default_layout(args.cache, args.layout, default_layout_name)
    return EngineShape(layout, args.block_size, args.tp, cross_layer=args.cross_layer)


def listed(kind: type, name: str) -> type:
    """An option that takes one value or a comma-separated list of them (one per engine)."""

    def parse(text: str) -> list[object]:
        try:
            values = [kind(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}[,{name}...], got {text!r}") from None
        return values

    return parse  # type: ignore[return-value]


def broadcast(options: dict[str, Sequence[object]]) -> int:
    """How many engines comma lists describe: every list has that many values, or one."""
    lengths = {len(v) for v in options.values() if len(v) > 1}
    if len(lengths) > 1:
        raise ValueError(f"{', '.join(sorted(options))} list different numbers of engines: {sorted(lengths)}")
    return lengths.pop() if lengths else 1
