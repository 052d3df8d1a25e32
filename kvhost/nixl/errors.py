"""The errors of transfers: NIXL missing, a transfer failing, a peer's message wrong, a wait without end."""

from __future__ import annotations

from kvhost.errors import BackendError, KVHostError


class NixlUnavailableError(BackendError):
    """NIXL (or the transfer backend asked for) cannot be loaded here."""


class TransferError(KVHostError, RuntimeError):
    """A transfer could not be prepared, failed, or did not finish in time.

    ``timed_out`` tells a deadline from a failure the transport reported.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class ProtocolError(KVHostError, ValueError):
    """A control message was malformed, truncated, unexpected, or did not arrive in time."""


class PeerClosedError(ProtocolError):
    """The peer's socket closed, or failed, before a whole frame arrived."""


class HoldLostError(ProtocolError):
    """Prefill did not confirm that it held a decode's blocks until ``done``: it had let go of
    them (its peer timeout passed without a beat, or it stopped), or could not say so in time.
    Blocks read from it may have been reused meanwhile: their bytes are not to be trusted."""


class InvalidTimeoutError(KVHostError, ValueError):
    """A timeout that is not a finite number of seconds in range (NaN, infinite, negative, a bool)."""
