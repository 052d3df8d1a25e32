"""Backend lookup by torch device type, through the ``kvhost.backends`` entry points.

Lazy in the manner of einops's backends: entry points are read on the first lookup, a
backend's heavy imports happen when it is first used, and the choice is cached per
device type. ``KVHOST_BACKEND=name`` picks a backend by name for the device types it
serves; a named backend that cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch

from kvhost.backend import Backend
from kvhost.errors import BackendError

ENTRY_POINT_GROUP = "kvhost.backends"
ENV_OVERRIDE = "KVHOST_BACKEND"


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
        self._lock = threading.RLock()
        self._classes: dict[str, type[Backend]] | None = None
        self._load_errors: dict[str, tuple[str, str]] = {}  # entry point name -> (its value, why)
        self._sources: dict[str, str] = {}  # backend name -> the value of the entry point that won
        self._instances: dict[str, Backend] = {}
        self._chosen: dict[tuple[str, str | None], Backend] = {}

    def classes(self) -> dict[str, type[Backend]]:
        """Every backend class the entry points name, loading them on first call."""
        with self._lock:
            if self._classes is None:
                self._classes = {}
                for point in entry_points(group=self._group):
                    try:
                        cls = point.load()
                    except Exception as err:  # a broken plugin must not break the others
                        self._load_errors[point.name] = (point.value, f"failed to load: {type(err).__name__}: {err}")
                        continue
                    if not (isinstance(cls, type) and issubclass(cls, Backend)):
                        self._load_errors[point.name] = (point.value, f"{point.value} is not a kvhost Backend")
                        continue
                    known = self._classes.get(cls.name)
                    if known is None or cls.priority > known.priority:
                        # Keyed by the backend's name, which need not be the entry point's.
                        self._classes[cls.name] = cls
                        self._sources[cls.name] = point.value
            return self._classes

    def info(self) -> list[BackendInfo]:
        rows = [
            BackendInfo(name, cls.device_types, cls.priority, self._sources[name], _reason(cls))
            for name, cls in self.classes().items()
        ]
        rows += [BackendInfo(name, (), 0, source, why) for name, (source, why) in self._load_errors.items()]
        return sorted(rows, key=lambda r: (r.device_types, -r.priority, r.name))

    def instance(self, name: str) -> Backend:
        with self._lock:
            if name not in self._instances:
                classes = self.classes()
                if name not in classes:
                    known = ", ".join(sorted(classes)) or "none"
                    why = self._load_errors.get(name, ("", "is not registered"))[1]
                    raise BackendError(f"backend {name!r} {why} (registered: {known})")
                cls = classes[name]
                reason = _reason(cls)
                if reason is not None:
                    raise BackendError(f"backend {name!r} cannot run here: {reason}")
                self._instances[name] = cls()
            return self._instances[name]

    def for_device(self, device: torch.device | str) -> Backend:
        """The backend for ``device``: ``KVHOST_BACKEND`` if it serves it, else the best usable."""
        device_type = torch.device(device).type
        override = os.environ.get(ENV_OVERRIDE) or None
        key = (device_type, override)
        with self._lock:
            if key not in self._chosen:
                self._chosen[key] = self._choose(device_type, override)
            return self._chosen[key]

    def _choose(self, device_type: str, override: str | None) -> Backend:
        classes = self.classes()
        if override is not None:
            if override not in classes:
                raise BackendError(
                    f"{ENV_OVERRIDE}={override!r} names no registered backend ({', '.join(sorted(classes))})"
                )
            if classes[override].serves(device_type):
                return self.instance(override)
        candidates = sorted(
            (cls for cls in classes.values() if cls.serves(device_type)),
            key=lambda cls: (-cls.priority, "*" in cls.device_types, cls.name),
        )
        reasons = []
        for cls in candidates:
            reason = _reason(cls)
            if reason is None:
                return self.instance(cls.name)
            reasons.append(f"{cls.name}: {reason}")
        raise BackendError(
            f"no usable backend for device type {device_type!r} ({'; '.join(reasons) or 'none registered'})"
        )

    def clear(self) -> None:
        """Forget every choice (for tests that change the environment)."""
        with self._lock:
            self._chosen.clear()


def _reason(cls: type[Backend]) -> str | None:
    try:
        return cls.unavailable_reason()
    except Exception as err:
        return f"availability check failed: {type(err).__name__}: {err}"


registry = Registry()


def get_backend(device: torch.device | str | torch.Tensor, name: str | None = None) -> Backend:
    """The backend kvhost uses for ``device`` (or a tensor's device); ``name`` picks one."""
    if isinstance(device, torch.Tensor):
        device = device.device
    if name is not None:
        backend = registry.instance(name)
        if not backend.serves(torch.device(device).type):
            raise BackendError(f"backend {name!r} does not serve device type {torch.device(device).type!r}")
        return backend
    return registry.for_device(device)
