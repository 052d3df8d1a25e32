"""Errors kvhost raises. Every one derives from KVHostError and names the value at fault.

All validation happens before any byte moves, so catching one of these means no cache
memory was touched.
"""

from __future__ import annotations


def shown(value: object, limit: int = 60) -> str:
    """``value`` for a message: its repr, cut to ``limit`` characters (what a peer, a plugin
    or a caller hands over may be huge, or have a repr that raises)."""
    try:
        text = repr(value)
    except Exception:
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown_name(name: object) -> str:
    """A name (a request's, a layer's) for a message: whole up to 200 characters (an
    engine's request ids are some 50), cut past that."""
    return shown(name, 200)


def failure(err: BaseException) -> str:
    """``Type: message`` of someone else's exception (a plugin's), even one whose message
    cannot be made."""
    try:
        text = str(err)
    except Exception:
        text = "(its message could not be read)"
    return f"{type(err).__name__}: {text}"


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or "" where it has none: compilers' and
    allocators' messages run to pages, and some exceptions carry no message at all."""
    try:
        lines = str(err).strip().splitlines()
    except Exception:
        return "(its message could not be read)"
    return lines[0] if lines else ""


def brief(err: BaseException) -> str:
    """``Type: first line`` of an exception (``Type`` alone where it has no message)."""
    line = first_line(err)
    return f"{type(err).__name__}: {line}" if line else type(err).__name__


class KVHostError(Exception):
    """Base class of every error kvhost raises on purpose."""


class LayoutError(KVHostError, ValueError):
    """A tensor or its axis letters describe a cache kvhost cannot handle."""


class RequestError(KVHostError, ValueError):
    """A request's block ids or remote spec are invalid (range, duplicates, groups, letters)."""


class ArgumentError(KVHostError, ValueError):
    """An argument outside what it may be: a bound below its least, an address that is not
    ``HOST:PORT``, an engine spec no engine can have."""


class BackendError(KVHostError, RuntimeError):
    """No usable backend for a device, or a backend failed to load."""
