"""A peer can send anything, a link can go down, a process can freeze: every wait kvhost
makes has a deadline, and every resource a peer can make it allocate is bounded.

- Timeouts: NaN, infinity, negative numbers, bools and non-numbers are refused, by
  ``Transfer.wait``, ``wire_protocol.receive``/``send`` and the demo's options alike.
"""

from __future__ import annotations

import math
import socket
import time
import types

import numpy as np
import pytest

from kvhost import demo
from kvhost.errors import KVHostError
from kvhost.nixl import Transfer
from kvhost.wire_protocol import (
    HEADER_BYTES,
    InvalidTimeoutError,
    ProtocolError,
    encode,
    receive,
    send,
)

MiB = 1 << 20

# --- every wait has a finite deadline -----------------------------------------------------------

ENDLESS = [math.nan, math.inf, -math.inf, -1, -1e-9, True, False, "1", None, 1e9, np.float64("nan")]


@pytest.mark.parametrize("timeout", ENDLESS, ids=repr)
def test_transfer_wait_refuses_a_timeout_that_is_not_finite_seconds(timeout):
    transfer = Transfer(types.SimpleNamespace(peer="p"), handle=None, nbytes=0, op="READ")
    started = time.monotonic()
    with pytest.raises(InvalidTimeoutError, match=r"Transfer\.wait timeout: expected a number of seconds") as raised:
        transfer.wait(timeout)
    assert isinstance(raised.value, KVHostError)
    assert (str(timeout) if isinstance(timeout, float) else repr(timeout)) in str(raised.value)
    assert time.monotonic() - started < 1  # refused, not waited on


@pytest.mark.parametrize("interval", [0, math.nan, math.inf, 2.0, -1])
def test_transfer_wait_refuses_a_poll_interval_out_of_range(interval):
    transfer = Transfer(types.SimpleNamespace(peer="p"), handle=None, nbytes=0, op="READ")
    with pytest.raises(InvalidTimeoutError, match=r"Transfer\.wait interval"):
        transfer.wait(1.0, interval=interval)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("timeout", ENDLESS, ids=repr)
def test_receive_and_send_refuse_a_timeout_that_is_not_finite_seconds(timeout):
    left, right = socket.socketpair()
    with left, right:
        right.sendall(encode("x", {}))
        with pytest.raises(
            InvalidTimeoutError, match=r"receive timeout: expected a number of seconds in \[0, 604800\]"
        ):
            receive(left, timeout=timeout)
        with pytest.raises(InvalidTimeoutError, match=r"send timeout"):
            send(left, "x", {}, timeout=timeout)
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, pytest.raises(InvalidTimeoutError, match=r"connect timeout"):
        demo.accept_hello(listener, None, timeout)


@pytest.mark.timeout(20)
def test_a_silent_peer_times_out_at_the_deadline():
    left, right = socket.socketpair()
    with left, right:
        right.sendall(encode("hello", {})[: HEADER_BYTES + 3])
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"timed out waiting for the JSON body: 3 of \d+ bytes"):
            receive(left, timeout=0.3)
        assert 0.25 < time.monotonic() - started < 3


@pytest.mark.parametrize("option", ["--timeout", "--connect-timeout", "--hold-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-5", "1e9", "soon"])
def test_the_demo_refuses_time_options_that_are_not_finite_seconds(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main([f"{option}={value}"])  # (a value like -inf would read as an option)
    assert exit_info.value.code == 2
    assert f"argument {option}: expected a number of seconds in (0, 604800], got {value!r}" in capsys.readouterr().err
