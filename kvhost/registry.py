"""Backend lookup by torch device type, through the ``kvhost.backends`` entry points.

Lazy in the manner of einops's backends: entry points are read on the first lookup, a
backend's heavy imports happen when it is first used, and the choice is cached per
device type. ``KVHOST_BACKEND=name`` picks a backend by name for the device types it
serves; a named backend that cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TypeVar

import torch

from kvhost.backend import Backend
from kvhost.errors import BackendError, failure, shown

ENTRY_POINT_GROUP = "kvhost.backends"
ENV_OVERRIDE = "KVHOST_BACKEND"
DISTRIBUTION = "kvhost"  # the distribution whose entry points are kvhost's own backends
_Key = TypeVar("_Key")


@dataclass(frozen=True)
class BackendInfo:
    """One registered backend as ``kvhost info`` shows it."""

    name: str
    device_types: tuple[str, ...]
    priority: int
    source: str  # the entry point's value
    unavailable: str | None  # None when usable here

    @property
    def available(self) -> bool:
        return self.unavailable is None


class Registry:
    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self._group = group
        # Loading the entry points, and the tables below. A plugin's first check and
        # constructor run under a lock of their device type's first choice, or of their
        # backend's name, not this one: a slow plugin delays only lookups that wait for it.
        self._lock = threading.RLock()
        self._choosing: dict[tuple[str, str | None], threading.RLock] = {}
        self._starting: dict[str, threading.RLock] = {}
        self._classes: dict[str, type[Backend]] | None = None
        self._loading = False  # the entry points are being imported (by this thread: it holds the lock)
        self._load_errors: dict[str, tuple[str, str]] = {}  # entry point name -> (its value, why)
        self._refused: dict[str, tuple[str, str]] = {}  # a refused class's backend name -> (its source, why)
        self._own: set[str] = set()  # names of kvhost's own backends (first among equal priorities)
        self._sources: dict[str, str] = {}  # backend name -> the value of the entry point kept
        self._instances: dict[str, Backend] = {}
        self._start_failures: dict[str, str] = {}  # backend name -> why its constructor raised
        self._chosen: dict[tuple[str, str | None], Backend] = {}

    def classes(self) -> dict[str, type[Backend]]:
        """Every backend class the entry points name, loading them on first call.

        kvhost's own entry points load first, then the others by distribution and entry
        point name, so which class keeps a shared backend name never depends on sys.path.
        """
        with self._lock:
            if self._classes is None:
                if self._loading:
                    # A plugin that looks a backend up as it is imported would see (and
                    # choose from) a registry without itself and the plugins after it.
                    raise BackendError(
                        "a backend was looked up while kvhost imports the backends' entry points "
                        "(from a plugin's import): look it up after the import, when one is needed"
                    )
                self._loading = True
                try:
                    self._classes = self._load()
                finally:
                    self._loading = False
            return self._classes

    def _load(self) -> dict[str, type[Backend]]:
        """The classes the entry points name; the tables of what failed are set with them."""
        classes: dict[str, type[Backend]] = {}
        kept_by: dict[str, EntryPoint] = {}  # backend name -> the entry point that holds it
        errors: dict[str, tuple[str, str]] = {}
        refused: dict[str, tuple[str, str]] = {}  # backend name -> (entry point, why), where it loaded
        try:
            points = sorted(entry_points(group=self._group), key=_load_order)
        except Exception as err:  # metadata no reader can parse: no backend can be known
            raise BackendError(
                f"the installed packages' {self._group!r} entry points cannot be read: {failure(err)}"
            ) from err
        for point in points:
            # A broken plugin must not break the others: anything wrong with one entry
            # point is recorded against it and the loop goes on.
            cls: object = None
            try:
                cls = point.load()
                problem = _class_problem(point, cls)
            except KeyboardInterrupt:
                raise
            except BaseException as err:  # a plugin that calls sys.exit on import ends no one's program
                problem = f"failed to load: {failure(err)}"
            name = getattr(cls, "name", None) if isinstance(cls, type) else None
            if problem is None and name in kept_by:
                holder = kept_by[name]
                problem = (
                    f"backend name {name!r} is already used by entry point {holder.name!r} "
                    f"({holder.value}); entry point {point.name!r} ({point.value}) is not registered"
                )
            if problem is not None:
                errors[point.name] = (point.value, problem)
                if isinstance(name, str):
                    refused.setdefault(name, (point.value, f"(entry point {point.name!r}) {problem}"))
                continue
            # Keyed by the backend's name, which need not be the entry point's.
            classes[name] = cls  # type: ignore[assignment,index]
            kept_by[name] = point  # type: ignore[index]
        # Published whole, so a lookup never sees a registry loaded halfway.
        self._sources = {name: point.value for name, point in kept_by.items()}
        self._own = {name for name, point in kept_by.items() if _distribution(point) == DISTRIBUTION}
        self._load_errors = errors
        self._refused = {name: why for name, why in refused.items() if name not in classes}
        return classes

    def _why_unknown(self, name: str) -> str | None:
        """Why no backend ``name`` is registered (to follow "backend 'name' "), where an
        entry point of that name, or one that loaded a class of that name, was refused; else None."""
        why = self._load_errors.get(name) or self._refused.get(name)
        return why[1] if why else None

    def info(self) -> list[BackendInfo]:
        rows = []
        for name, cls in self.classes().items():
            reason = _reason(cls)  # a plugin's check, run once a row: it may be slow
            why = reason if reason is not None else self._start_failures.get(name)
            rows.append(BackendInfo(name, _device_types(cls), cls.priority, self._sources[name], why))
        rows += [BackendInfo(name, (), 0, source, why) for name, (source, why) in self._load_errors.items()]
        return sorted(rows, key=lambda r: (r.device_types, -r.priority, r.name))

    def instance(self, name: str) -> Backend:
        started = self._instances.get(name)
        if started is not None:  # usable when it started: no lock, no plugin code on every call
            return started
        classes = self.classes()
        if name not in classes:
            known = ", ".join(sorted(classes)) or "none"
            why = self._why_unknown(name) or "is not registered"
            raise BackendError(f"backend {name!r} {why} (registered: {known})")
        reason = _reason(classes[name])
        if reason is not None:
            raise BackendError(f"backend {name!r} cannot run here: {reason}")
        backend = self._start(name)
        if isinstance(backend, str):
            raise BackendError(f"backend {name!r} ({self._sources[name]}) {backend}")
        return backend

    def for_device(self, device: torch.device | str) -> Backend:
        """The backend for ``device``: ``KVHOST_BACKEND`` if it serves it, else the best usable."""
        device_type = _device_type(device)
        override = os.environ.get(ENV_OVERRIDE) or None
        key = (device_type, override)
        chosen = self._chosen.get(key)
        if chosen is not None:  # a lookup once chosen waits for no other thread's first one
            return chosen
        with self._lock_of(self._choosing, key):
            if key not in self._chosen:
                self._chosen[key] = self._choose(device_type, override)
            return self._chosen[key]

    def _lock_of(self, locks: dict[_Key, threading.RLock], key: _Key) -> threading.RLock:
        with self._lock:
            return locks.setdefault(key, threading.RLock())

    def _start(self, name: str) -> Backend | str:
        """The one instance of backend ``name``, made on first use, or why making it failed.

        A failure is kept (shown by ``info()``) until ``clear()``: a constructor that raised
        once is not run again on every lookup.
        """
        with self._lock_of(self._starting, name):  # made once, whichever thread asks first
            if name not in self._instances and name not in self._start_failures:
                try:
                    self._instances[name] = self.classes()[name]()
                except KeyboardInterrupt:
                    raise
                except BaseException as err:  # an abstract class, or a device runtime that will not start
                    self._start_failures[name] = f"failed to start: {failure(err)}"
            if name in self._instances:
                return self._instances[name]
            return self._start_failures[name]

    def _choose(self, device_type: str, override: str | None) -> Backend:
        classes = self.classes()
        if override is not None:
            if override not in classes:
                why = self._why_unknown(override)  # an entry point or class of that name that did not load
                raise BackendError(
                    f"{ENV_OVERRIDE}={override!r} names no registered backend ({', '.join(sorted(classes))})"
                    + (f": backend {override!r} {why}" if why else "")
                )
            if _serves(classes[override], device_type):
                return self.instance(override)
        candidates = sorted(
            (cls for cls in classes.values() if _serves(cls, device_type)),
            key=lambda cls: (-cls.priority, "*" in cls.device_types, cls.name not in self._own, cls.name),
        )
        reasons = []
        for cls in candidates:
            reason = _reason(cls)
            if reason is not None:
                reasons.append(f"{cls.name}: {reason}")
                continue
            backend = self._start(cls.name)
            if not isinstance(backend, str):
                return backend
            # The next candidate may still serve: this one's failure is only its reason.
            reasons.append(f"{cls.name} ({self._sources[cls.name]}): {backend}")
        raise BackendError(
            f"no usable backend for device type {device_type!r} ({'; '.join(reasons) or 'none registered'})"
        )

    def clear(self) -> None:
        """Forget every choice and failed start (for tests that change the environment)."""
        with self._lock:
            self._chosen.clear()
            self._start_failures.clear()


def _load_order(point: EntryPoint) -> tuple[bool, str, str]:
    """kvhost's own entry points first, then by distribution name and entry point name."""
    dist = _distribution(point)
    return (dist != DISTRIBUTION, dist, point.name)


def _distribution(point: EntryPoint) -> str:
    """The lower-case name of the distribution declaring ``point``; empty where it has none
    (a dist-info whose METADATA is gone, as an interrupted install leaves it)."""
    name = getattr(point.dist, "name", None)
    return name.lower() if isinstance(name, str) else ""


def _class_problem(point: EntryPoint, cls: object) -> str | None:
    """Why what ``point`` loaded cannot be registered, or None when it can.

    Checked here, once, because the registry sorts and compares these attributes on every
    lookup and in ``info()``: a wrong one found later would break every backend.
    """
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return f"{point.value} is not a kvhost Backend"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        return f"{point.value} has no backend name: set the class attribute `name` to a non-empty str"
    priority = cls.priority
    if not isinstance(priority, int) or isinstance(priority, bool):  # True would sort as 1
        return f"{point.value}: priority must be an int, got {priority!r}"
    types = getattr(cls, "device_types", None)
    if not isinstance(types, Collection) or isinstance(types, str) or not all(isinstance(t, str) for t in types):
        wanted = "a collection of str device types, such as ('hpu',)"
        return f"{point.value}: device_types must be {wanted}, got {types!r}"
    return None


def _device_types(cls: type[Backend]) -> tuple[str, ...]:
    """``cls.device_types`` as a tuple, in a stable order where it has none of its own."""
    types = cls.device_types
    return tuple(types) if isinstance(types, Sequence) else tuple(sorted(types))


def _device_type(device: torch.device | str) -> str:
    """The type of ``device`` as torch parses it, or a BackendError naming what was given."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError) as err:
        # torch's own message lists every device type it knows, or every signature of torch.device.
        raise BackendError(f"no backend for device {shown(device)}: torch.device() does not accept it") from err


def _reason(cls: type[Backend]) -> str | None:
    """Why ``cls`` cannot run here, None when it can: a plugin's answer, held to the contract."""
    try:
        reason = cls.unavailable_reason()
    except KeyboardInterrupt:
        raise
    except BaseException as err:
        return f"availability check failed: {failure(err)}"
    if reason is None or (isinstance(reason, str) and reason):
        return reason
    return f"availability check returned {shown(reason)}, not None (usable) or a reason (a non-empty str)"


def _serves(cls: type[Backend], device_type: str) -> bool:
    """``cls.serves(device_type)``; a plugin's override that raises serves nothing, and
    breaks no other backend's lookup."""
    try:
        return bool(cls.serves(device_type))
    except KeyboardInterrupt:
        raise
    except BaseException:
        return False


registry = Registry()


def get_backend(device: torch.device | str | torch.Tensor, name: str | None = None) -> Backend:
    """The backend kvhost uses for ``device`` (or a tensor's device); ``name`` picks one."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if name is not None:
        if not isinstance(name, str):
            raise BackendError(f"a backend's name must be a string, got {shown(name)}")
        device_type = _device_type(device)
        backend = registry.instance(name)
        if not _serves(type(backend), device_type):
            raise BackendError(f"backend {name!r} does not serve device type {device_type!r}")
        return backend
    return registry.for_device(device)
