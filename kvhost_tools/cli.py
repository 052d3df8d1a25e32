"""The ``kvhost`` command: ``info``, ``demo``, ``prefill``, ``decode``, ``bench``.

Nothing is imported before the subcommand is known: ``kvhost demo`` starts its engine
processes without loading torch itself.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence


def visible_devices(device_types: Sequence[str] = ()) -> list[str]:
    """Devices torch can see here, one per accelerator index, the host first: CUDA, XPU,
    and any other ``device_types`` (a plugin's, such as ``hpu``) whose torch module says so."""
    import torch

    devices = ["cpu"]
    for device_type in dict.fromkeys(("cuda", "xpu", *device_types)):
        module = getattr(torch, device_type, None)
        try:  # a plugin's device module: one that fails to answer shows no device
            count = module.device_count() if module is not None and module.is_available() else 0
        except Exception:
            count = 0
        devices += [f"{device_type}:{i}" for i in range(count)]
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        devices += [str(d) for d in xm.get_xla_supported_devices()]
    return devices


def info(args: argparse.Namespace) -> int:
    import torch

    from kvhost.errors import KVHostError
    from kvhost.registry import registry

    # Chosen first, so that the table shows a backend whose constructor failed as such.
    served = {t for cls in registry.classes().values() for t in cls.device_types} - {"*", "cpu", "meta"}
    chosen: list[tuple[str, str]] = []
    unserved = 0
    for device in visible_devices(sorted(served)):
        try:
            backend = registry.for_device(device)
        except KVHostError as err:
            chosen.append((device, f"none: {err}"))
            unserved += 1
            continue
        try:  # a plugin's own words: one that fails or says no text must not end the listing
            detail = backend.describe()
        except Exception as err:
            detail = f"describe() failed: {type(err).__name__}: {err}"
        chosen.append((device, backend.name + (f" ({detail})" if detail else "")))
    rows = registry.info()
    name_width = max([10, *(len(row.name) for row in rows)])
    types_width = max([12, *(len(",".join(row.device_types)) for row in rows)])
    print(f"kvhost backends (torch {torch.__version__})")
    print(f"  {'name':<{name_width}} {'devices':<{types_width}} {'priority':>8}  status")
    for row in rows:
        status = "available" if row.available else f"unavailable: {row.unavailable}"
        types = ",".join(row.device_types) or "-"
        print(f"  {row.name:<{name_width}} {types:<{types_width}} {row.priority:>8}  {status}")
    override = os.environ.get("KVHOST_BACKEND")
    where = f" (KVHOST_BACKEND={override!r}, for the device types that backend serves)" if override else ""
    print(f"chosen per visible device{where}:")
    device_width = max([10, *(len(device) for device, _ in chosen)])
    for device, what in chosen:
        print(f"  {device:<{device_width}} -> {what}")
    return 1 if unserved else 0  # a device no backend serves (a per-backend CI job's check)


# Subcommands that own their options live in their own modules, loaded only when run.
DELEGATED = {
    "demo": ("kvhost_tools.demo.cli", "prefill -> decode hand-offs over real NIXL on this host, verified bit for bit"),
    "prefill": ("kvhost_tools.demo.prefill", "a prefill engine: serves its KV blocks to decode engines (any host)"),
    "decode": ("kvhost_tools.demo.decode", "a decode engine: pulls from prefill engines, post-processes, verifies"),
    "bench": ("kvhost_tools.bench.cli", "memcpy roofline, the per-request baseline and kvhost, side by side"),
}
ENGINES = ("demo", "prefill", "decode")  # commands that run engines (the bench parks its workers itself)
DESCRIPTION = (
    "kvhost moves and rearranges KV-cache blocks for disaggregated LLM serving: batched host "
    "staging and the receive-side post-process, one call per batch. Each command's --help "
    "says more; README.md and docs/ say the rest."
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvhost")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        if argv[0] in ENGINES:
            from kvhost_tools.demo.netenv import park_workers

            park_workers(os.environ)  # before the engine imports torch (netenv says why)
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]))
    parser = argparse.ArgumentParser(prog="kvhost", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvhost {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="backends, their availability, and the choice per device").set_defaults(run=info)
    for name, (_, summary) in DELEGATED.items():
        commands.add_parser(name, help=summary, add_help=False)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
