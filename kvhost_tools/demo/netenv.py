"""Where NIXL/UCX listen and how much they say: the environment the commands set unless the user did.

UCX chooses its interfaces from ``UCX_NET_DEVICES`` and its transports from ``UCX_TLS``.
The commands set ``UCX_NET_DEVICES`` to the interface of the address an engine works on
(``lo`` on loopback, the default: nothing listens beyond it), and quieten UCX and NIXL
(``UCX_LOG_LEVEL=error``, ``NIXL_LOG_LEVEL=ERROR``), each only where the user has not
set it. ``UCX_TLS`` is the user's: on a real network UCX picks the best transport
itself; two network namespaces of one machine look to UCX like one host, so it reads
through shared memory unless told ``UCX_TLS=tcp`` (the namespace test does).

The engines also park idle OpenMP workers (``OMP_WAIT_POLICY=PASSIVE``, ``park_workers``)
unless the user chose a policy. An OpenMP runtime reads it once, when it loads (torch's
when torch is imported), so the commands set it before anything imports torch. GNU
OpenMP's default keeps a worker spinning after each parallel region; in an engine whose
NIXL progress thread and UCX threads want the same cores, decode's post-process of the
demo's batch took 16-684 ms (median 74) in 8 runs here, against 16-32 ms (median 20) in 8
runs with the workers parked, alternated. ``kvhost bench`` measures with them parked too.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
from collections.abc import Iterable, MutableMapping

QUIET = {"UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "ERROR"}
SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the interface that holds the IPv4 ``address``, or None (not found, not IPv4)."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.is_loopback:
        return "lo"
    if wanted.version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                request = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
                if socket.inet_ntoa(answer[20:24]) == str(wanted):
                    return name
    return None


def advertise_refusal(address: str | None) -> str | None:
    """Why ``--advertise`` cannot name this host's interface (one line), or None: an IPv4
    address no interface here holds would leave UCX on every interface, unsaid."""
    if address is None:
        return None
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return f"--advertise {address!r}: not an IP address"
    if parsed.version == 4 and not parsed.is_unspecified and interface_of(address) is None:
        return f"--advertise {address}: no interface of this host has that address"
    return None


def route_source(host: str, port: int) -> str | None:
    """The local address this host would reach ``host`` from (no packet is sent), or None;
    None for a host name too: its lookup has no deadline here (the connect looks it up under one)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
    return None


def namespace_link(netns: str) -> tuple[str, str]:
    """``(ours, theirs)``: the interface here and the one in network namespace ``netns``
    between which this host reaches that namespace's first IPv4 address (a veth pair, say).
    A ValueError says why there is none, in one line."""
    try:
        listed = subprocess.run(
            ["ip", "-n", netns, "-o", "-4", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"cannot list its addresses: {err}") from None
    if listed.returncode:
        raise ValueError(listed.stderr.strip().splitlines()[-1] if listed.stderr.strip() else "ip failed")
    for line in listed.stdout.splitlines():  # "3: kvB    inet 10.9.0.2/24 brd ... scope global kvB"
        fields = line.split()
        theirs, address = fields[1], fields[3].split("/")[0]
        ours = interface_of(route_source(address, 9) or "")
        if ours not in (None, "lo"):
            return ours, theirs
    raise ValueError("no IPv4 address there that this host reaches through an interface of its own")


def ucx_devices(addresses: Iterable[str]) -> str | None:
    """``UCX_NET_DEVICES`` for an engine working on ``addresses`` (its own): their interfaces,
    or None where one cannot be told (a wildcard address, IPv6 beyond loopback)."""
    names: list[str] = []
    for address in addresses:
        if address in ("0.0.0.0", "::", ""):
            return None
        name = interface_of(address)
        if name is None:
            return None
        if name not in names:
            names.append(name)
    return ",".join(names) or None


def set_defaults(env: MutableMapping[str, str], addresses: Iterable[str]) -> dict[str, str]:
    """Quiet transports and UCX on the interfaces of ``addresses``, where ``env`` does not say
    otherwise; returns what was set."""
    chosen = dict(QUIET)
    devices = ucx_devices(addresses)
    if devices is not None:
        chosen["UCX_NET_DEVICES"] = devices
    added = {key: value for key, value in chosen.items() if key not in env}
    env.update(added)
    return added


def park_workers(env: MutableMapping[str, str]) -> None:
    """Idle OpenMP workers wait without spinning, where ``env`` names no wait policy."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def describe_network() -> str:
    """UCX's settings as this process runs with them, for the report."""
    devices = os.environ.get("UCX_NET_DEVICES", "all")
    transports = os.environ.get("UCX_TLS")
    where = "127.0.0.1" if devices == "lo" else f"UCX_NET_DEVICES={devices}"
    return where + (f", UCX_TLS={transports}" if transports else "")
