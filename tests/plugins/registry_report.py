"""What kvhost's registry sees in this environment, as JSON on stdout.

Run in a subprocess by tests/test_plugin_contract.py, with and without the demo plugin
on ``PYTHONPATH``: entry points are read once per process, so each environment needs a
fresh interpreter. Nothing here touches the registry's internals.
"""

from __future__ import annotations

import importlib.util
import json
import os

import kvhost
from kvhost.registry import registry
from kvhost.testing import CopyCase, ReceiveCase, fill_random, make_cache


def demo_calls() -> dict[str, int] | None:
    """How often the demo plugin's backend ran in this process; None without the plugin."""
    if importlib.util.find_spec("kvhost_demo_plugin") is None:
        return None
    from kvhost_demo_plugin import DemoBackend

    return dict(DemoBackend.calls)


def main() -> None:
    report: dict[str, object] = {}
    report["info"] = {
        row.name: {
            "device_types": list(row.device_types),
            "priority": row.priority,
            "source": row.source,
            "unavailable": row.unavailable,
        }
        for row in registry.info()
    }
    report["chosen"] = {device: kvhost.get_backend(device).name for device in ("cpu", "meta")}
    report["named_cpu"] = kvhost.get_backend("cpu", "cpu").name

    # No backend named: the registry picks by the caches' device type and priority.
    caches = {"l0": make_cache("KBNHC", "KBNHC", dict(K=2, B=6, N=4, H=2, C=4))}
    case = ReceiveCase(caches, "KBNHC", seed=1)
    case.send("r", [4, 1], "HNC", 2)
    stats = kvhost.receive(caches, {"r": [4, 1]}, axes="KBNHC", remote_order="HNC", remote_block_size=2)
    case.check()  # the bytes are right, whichever backend ran
    host = {"l0": fill_random(make_cache("KBNHC", "KBNHC", dict(K=2, B=3, N=4, H=2, C=4)), seed=2)}
    copy = CopyCase(caches, host, "KBNHC", "KBNHC")
    copied = kvhost.copy_blocks(caches, host, [4, 1], [2, 0], axes="KBNHC").wait()
    copy.check([4, 1], [2, 0])  # every pair landed; every other block of both sides kept its bytes
    report["receive_backend"], report["copy_backend"] = stats.backend, copied.backend
    report["demo_calls"] = demo_calls()

    # KVHOST_BACKEND names a backend for the device types it serves; choices are made per
    # (device type, KVHOST_BACKEND), so setting it now takes effect for the next lookup.
    os.environ["KVHOST_BACKEND"] = "cpu"
    case.send("s", [2, 5], "HNC", 2)
    stats = kvhost.receive(caches, {"s": [2, 5]}, axes="KBNHC", remote_order="HNC", remote_block_size=2)
    case.check()
    report["override_cpu"] = {
        "chosen": {device: kvhost.get_backend(device).name for device in ("cpu", "meta")},
        "receive_backend": stats.backend,
        "demo_calls": demo_calls(),
    }
    del os.environ["KVHOST_BACKEND"]
    try:
        kvhost.get_backend("cpu", "demo-absent")
        report["absent_error"] = None
    except kvhost.BackendError as err:
        report["absent_error"] = str(err)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
