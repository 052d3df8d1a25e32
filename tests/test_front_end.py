"""The front end's choices, each pinned by a batch that only it decides.

kvhost/batch.py and kvhost/api.py: which sender order and block size a request takes
when it names only one of them (or neither, nor the call), layers whose layouts differ so
that one needs work and another does not, a request with no ids under its own transform,
and an empty copy. Found by mutation testing (ci/mutation.py).
"""

from __future__ import annotations

import pytest
import torch

import kvhost
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw

SIZES = dict(K=2, B=8, N=8, H=2, C=4)


class Recorder(kvhost.Backend):
    """Records the jobs it gets and hands them to the torch backend."""

    name = "recorder"
    device_types = ("*",)

    def __init__(self) -> None:
        self.jobs: list[object] = []
        self.torch = kvhost.get_backend(torch.device("meta"), "torch")

    def receive(self, job):  # type: ignore[no-untyped-def]
        self.jobs.append(job)
        self.torch.receive(job)

    def copy(self, job):  # type: ignore[no-untyped-def]
        self.jobs.append(job)
        return self.torch.copy(job)


def test_a_request_that_names_half_its_sender_takes_the_rest_from_the_call(target):
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12), device=target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=3)
    case.send("size only", [1, 2, 3, 4], "HNC", 16)
    case.send("order only", [5, 6], "CNH", 4)
    case.send("neither", [7], "HNC", 4)
    requests = {
        "size only": kvhost.Incoming([1, 2, 3, 4], remote_block_size=16),
        "order only": kvhost.Incoming([5, 6], remote_order="CNH"),
        "neither": kvhost.Incoming([7]),
    }
    stats = kvhost.receive(
        caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=target.backend
    )
    case.check()
    assert stats.groups == 3


def test_without_a_sender_spec_anywhere_the_local_one_is_assumed(target):
    if target.device == "xla":
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    # Head-major blocks: a sender of 4-token blocks in the local region order is work.
    caches = {"l": make_cache("KBNHC", "KBHNC", SIZES, device=target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=4)
    case.send("r", [2, 5], "HNC", 4)
    stats = kvhost.receive(caches, {"r": [2, 5]}, axes="KBNHC", remote_block_size=4, backend=target.backend)
    case.check()
    assert stats.groups == 1
    case = ReceiveCase(caches, "KBNHC", seed=5)
    case.send("r", [3], "CNH", 8)
    kvhost.receive(caches, {"r": [3]}, axes="KBNHC", remote_order="CNH", backend=target.backend)
    case.check()


@pytest.mark.parametrize("first", ["token-major", "head-major"])
def test_without_a_sender_order_layers_that_differ_each_keep_their_own(first):
    """No remote order anywhere: the sender is laid out like the caches, layer by layer. A
    set whose layers (or K and V) differ in strides is not rewritten by the first one's
    order, whichever comes first; with another block size each layer gets its own order's
    sender blocks."""
    memories = {"token-major": "KBNHC", "head-major": "KBHNC"}
    second = "head-major" if first == "token-major" else "token-major"
    caches = {name: make_cache("KBNHC", memories[name], SIZES) for name in (first, second)}
    for seed, tensor in enumerate(caches.values()):
        fill_random(tensor, seed)
    before = {name: raw(tensor).clone() for name, tensor in caches.items()}
    stats = kvhost.receive(caches, {"r": [1, 6]}, axes="KBNHC")
    assert stats.groups == 0 and stats.skipped_blocks == 2
    assert all(torch.equal(raw(caches[name]), before[name]) for name in caches)
    pair = {"l": tuple(caches[name][k] for k, name in enumerate(caches))}  # K one layout, V the other
    assert kvhost.receive(pair, {"r": [2]}, axes="KBNHC").groups == 0
    assert all(torch.equal(raw(caches[name]), before[name]) for name in caches)
    cases = [ReceiveCase({name: caches[name]}, "KBNHC", seed=7) for name in caches]
    for case, name in zip(cases, caches):
        case.send("r", [1, 6], {"token-major": "NHC", "head-major": "HNC"}[name], 4)
    stats = kvhost.receive(caches, {"r": [1, 6]}, axes="KBNHC", remote_block_size=4)
    for case in cases:
        case.check()
    assert stats.groups == 1


def test_layers_whose_layouts_differ_are_planned_one_by_one():
    # Layer a is token-major, layer b head-major: a token-major sender is the identity
    # for a and a transpose for b; the batch is not skipped, and only b is rewritten.
    caches = {"a": make_cache("KBNHC", "KBNHC", SIZES), "b": make_cache("KBNHC", "KBHNC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=6)
    case.send("r", [1, 6], "NHC", 8)
    recorder = Recorder()
    stats = kvhost.receive(caches, {"r": [1, 6]}, axes="KBNHC", remote_order="NHC", backend=recorder)
    case.check()
    assert [job.members[0].layer for job in recorder.jobs] == ["b"]  # type: ignore[attr-defined]
    assert (stats.groups, stats.skipped_blocks) == (1, 0)
    assert stats.bytes_moved == 2 * 2 * 8 * 2 * 4 * 2  # b only: blocks x K x region bytes


def test_a_request_with_no_ids_makes_no_group(target):
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES, device=target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=7)
    case.send("r", [4], "HNC", 4)
    requests = {"r": [4], "none": kvhost.Incoming([], "CNH", 2)}
    stats = kvhost.receive(
        caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=target.backend
    )
    case.check()
    assert (stats.groups, stats.blocks, stats.requests) == (1, 1, 2)


def test_an_empty_copy_reaches_no_backend():
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)}
    dst = {"l": make_cache("KBNHC", "KBHNC", SIZES)}
    recorder = Recorder()
    result = kvhost.copy_blocks(src, dst, [], [], axes="KBNHC", backend=recorder)
    assert recorder.jobs == [] and result.job is None and result.blocks == 0
    kvhost.copy_blocks(src, dst, [1], [2], axes="KBNHC", backend=recorder)
    assert len(recorder.jobs) == 1


def test_a_call_that_moves_no_byte_does_not_look_at_a_registered_cache():
    # Only calls with work check that registered caches are still in place; an identity
    # batch is only counted (docs/design.md, "Data flow").
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    host = kvhost.KVHost(caches, axes="KBNHC")
    caches["l"].set_(torch.zeros_like(caches["l"]))  # re-pointed after registration
    stats = host.receive({"r": [1]}, remote_order="NHC", remote_block_size=8)
    assert stats.skipped_blocks == 1
    with pytest.raises(kvhost.LayoutError, match="changed since it was registered"):
        host.receive({"r": [1]}, remote_order="HNC", remote_block_size=8)


def test_copies_wait_for_their_bytes_unless_asked_not_to():
    caches = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)}
    host_buffer = {"l": make_cache("KBNHC", "KBHNC", SIZES)}
    recorder = Recorder()
    kvhost.copy_blocks(caches, host_buffer, [1], [1], axes="KBNHC", backend=recorder)
    host = kvhost.KVHost(caches, axes="KBNHC", backend=recorder)
    host.copy_to(host_buffer, [2], [2])
    host.copy_from(host_buffer, [2], [3])
    kvhost.copy_blocks(caches, host_buffer, [4], [4], axes="KBNHC", backend=recorder, non_blocking=True)
    assert [job.non_blocking for job in recorder.jobs] == [False, False, False, True]  # type: ignore[attr-defined]


class _Tracked(kvhost.Completion):
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(self.name)


def test_waiting_on_a_copy_waits_on_every_backend_call():
    log: list[str] = []

    class Tracking(Recorder):
        def copy(self, job):  # type: ignore[no-untyped-def]
            super().copy(job)
            return _Tracked(log, f"job{len(self.jobs)}")

    # Two layers in two layouts: two copy groups, two backend calls.
    src = {
        "a": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1),
        "b": fill_random(make_cache("KBNHC", "KBHNC", SIZES), 2),
    }
    dst = {"a": make_cache("KBNHC", "KBNHC", SIZES), "b": make_cache("KBNHC", "KBNHC", SIZES)}
    result = kvhost.copy_blocks(src, dst, [1, 2, 5], [3, 4, 6], axes="KBNHC", backend=Tracking())
    assert result.runs == 2  # 1, 2 -> 3, 4 and 5 -> 6
    result.wait()
    assert log == ["job1", "job2"]


def test_a_copy_of_one_job_hands_back_that_job_s_completion():
    # Nothing to combine: the caller waits on what the backend returned, itself.
    returned: list[object] = []

    class Handing(Recorder):
        def copy(self, job):  # type: ignore[no-untyped-def]
            super().copy(job)
            returned.append(_Tracked([], "only"))
            return returned[-1]

    src = {"a": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)}
    dst = {"a": make_cache("KBNHC", "KBNHC", SIZES)}
    result = kvhost.copy_blocks(src, dst, [1, 2], [3, 4], axes="KBNHC", backend=Handing())
    assert len(returned) == 1 and result.completion is returned[0]


def test_copies_run_on_the_backend_of_the_device_side():
    # meta stands in for an accelerator: the host side never picks the backend.
    from kvhost.api import _copy_device

    cpu, meta, cuda = torch.device("cpu"), torch.device("meta"), torch.device("cuda")
    assert [_copy_device(*pair) for pair in [(cpu, meta), (meta, cpu), (meta, meta), (cpu, cpu)]] == [
        meta,
        meta,
        meta,
        cpu,
    ]
    with pytest.raises(kvhost.LayoutError, match="cannot copy between meta and cuda: stage through host memory"):
        _copy_device(meta, cuda)
    host = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES), 1)}
    device = {"l": make_cache("KBNHC", "KBNHC", SIZES, device="meta")}
    assert kvhost.copy_blocks(host, device, [1], [1], axes="KBNHC").backend == "torch"
    recorder = Recorder()
    registered = kvhost.KVHost(host, axes="KBNHC", backend=recorder)
    assert registered.copy_to(device, [1], [1]).backend == "torch"  # not the host cache's own backend
    assert registered.copy_to({"l": make_cache("KBNHC", "KBNHC", SIZES)}, [1], [1]).backend == "recorder"
    assert len(recorder.jobs) == 1


def test_a_call_reports_the_seconds_it_took():
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    stats = kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    assert 0 < stats.seconds < 60


class RefusesTheLastGroup(Recorder):
    """Can do every job but the batch's last: as a backend whose device cannot index it."""

    name = "refuses-the-last-group"

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.checked = 0

    def check_receive(self, job):  # type: ignore[no-untyped-def]
        self.checked += 1
        if self.checked == self.groups:
            raise kvhost.BackendError(f"cannot do group {self.checked}")


def test_a_job_the_backend_refuses_stops_the_batch_before_any_job_runs(target):
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12), device=target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=6)
    case.send("a", [1, 2], "HNC", 8)
    case.send("b", [5], "CNH", 8)
    case.send("c", [7, 9], "HNC", 4)
    wire = case.snapshot()
    requests = {
        "a": kvhost.Incoming([1, 2], "HNC", 8),
        "b": kvhost.Incoming([5], "CNH", 8),
        "c": kvhost.Incoming([7, 9], "HNC", 4),
    }
    backend = RefusesTheLastGroup(groups=3)
    with pytest.raises(kvhost.BackendError, match="cannot do group 3"):
        kvhost.receive(caches, requests, axes="KBNHC", backend=backend)
    assert backend.checked == 3 and backend.jobs == []
    assert case.same_as(wire)
    backend = RefusesTheLastGroup(groups=4)  # checks pass: the same batch is done whole
    assert kvhost.receive(caches, requests, axes="KBNHC", backend=backend).groups == 3
    assert backend.checked == 3 and len(backend.jobs) == 3
    case.check()


class RefusesTheLastCopyJob(RefusesTheLastGroup):
    def check_copy(self, job):  # type: ignore[no-untyped-def]
        self.check_receive(job)


def test_a_copy_job_the_backend_refuses_stops_the_copy_before_any_job_runs():
    """Host layers of two layouts are two copy jobs: the second refused, the first never ran."""
    src = {"a": make_cache("KBNHC", "KBNHC", SIZES), "b": make_cache("KBNHC", "KBHNC", SIZES)}
    dst = {name: torch.zeros(tuple(t.shape), dtype=t.dtype) for name, t in src.items()}
    backend = RefusesTheLastCopyJob(groups=2)
    with pytest.raises(kvhost.BackendError, match="cannot do group 2"):
        kvhost.copy_blocks(src, dst, [0, 1], [2, 3], axes="KBNHC", backend=backend)
    assert backend.checked == 2 and backend.jobs == []
    assert not any(t.any() for t in dst.values())


class PluginFailures(Recorder):
    """A plugin whose checks or lock raise exceptions of its own (``fails`` names which)."""

    name = "plugin-failures"

    def __init__(self, fails: str) -> None:
        super().__init__()
        self.fails = fails

    def check_receive(self, job):  # type: ignore[no-untyped-def]
        if self.fails == "check_receive":
            raise ValueError("unit too large")

    def check_copy(self, job):  # type: ignore[no-untyped-def]
        if self.fails == "check_copy":
            raise ValueError("copy too large")

    def exclusive(self):  # type: ignore[no-untyped-def]
        if self.fails == "exclusive":
            raise OSError("lock file gone")
        if self.fails == "no lock":
            return None
        if self.fails == "lock raises":
            return RefusingLock()
        if self.fails == "own refusal":
            raise kvhost.BackendError("plugin-failures: the device is being reset")
        return super().exclusive()

    def receive(self, job):  # type: ignore[no-untyped-def]
        if self.fails == "receive":
            raise ZeroDivisionError("device fault")
        super().receive(job)


class RefusingLock:
    def __enter__(self) -> None:
        raise TimeoutError("lock busy")

    def __exit__(self, *exc: object) -> None:
        raise AssertionError("never entered")


@pytest.mark.parametrize(
    ("fails", "message"),
    [
        ("check_receive", r"check_receive failed \(nothing was moved\): ValueError: unit too large$"),
        ("check_copy", r"check_copy failed \(nothing was moved\): ValueError: copy too large$"),
        ("exclusive", r"exclusive\(\) gave no lock to hold \(nothing was moved\): OSError: lock file gone$"),
        ("no lock", r"exclusive\(\) gave no lock to hold \(nothing was moved\): AttributeError: .*__enter__"),
        ("lock raises", r"exclusive\(\) gave no lock to hold \(nothing was moved\): TimeoutError: lock busy$"),
        ("own refusal", None),  # a KVHostError of its own goes as it is
    ],
)
def test_a_plugin_s_own_exception_before_any_byte_moves_is_a_backend_error_naming_it(fails, message):
    """Checks and the lock run before any byte moves: what a plugin raises there is a
    refusal, a BackendError naming the plugin, with no byte changed (receive and copy)."""
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12))}
    case = ReceiveCase(caches, "KBNHC", seed=7)
    case.send("a", [1, 2], "HNC", 8)
    wire = case.snapshot()
    backend = PluginFailures(fails)
    dst = {"l": torch.zeros(tuple(caches["l"].shape), dtype=caches["l"].dtype)}
    calls = {
        "receive": lambda: kvhost.receive(
            caches, {"a": [1, 2]}, axes="KBNHC", remote_order="HNC", remote_block_size=8, backend=backend
        ),
        "copy": lambda: kvhost.copy_blocks(caches, dst, [1, 2], [3, 4], axes="KBNHC", backend=backend),
    }
    refused = [name for name in calls if fails not in ("check_receive", "check_copy") or name in fails]
    for name in refused:
        expected = (
            f"^backend 'plugin-failures': {message}" if message else "^plugin-failures: the device is being reset$"
        )
        with pytest.raises(kvhost.BackendError, match=expected):
            calls[name]()
    assert backend.jobs == [] and case.same_as(wire) and not dst["l"].any()


def test_a_plugin_s_own_exception_during_the_work_is_a_backend_error_saying_what_may_have_moved():
    """Raised from ``receive`` (bytes may have moved): a BackendError, its cause the plugin's
    own exception, not worded as a refusal."""
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12))}
    failing = r"^backend 'plugin-failures' failed in job 1 of 1 of a receive: ZeroDivisionError: device fault; "
    with pytest.raises(
        kvhost.BackendError, match=failing + r"request 'a' \(layers \['l'\]\) may be rearranged in part$"
    ) as caught:
        kvhost.receive(caches, {"a": [1, 2]}, axes="KBNHC", remote_order="HNC", remote_block_size=8,
                       backend=PluginFailures("receive"))  # fmt: skip
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


class FailsOnItsSecondJob(Recorder):
    """Its second job of a call (receive or copy) raises; the first ran."""

    name = "fails-second"

    def receive(self, job):  # type: ignore[no-untyped-def]
        if self.jobs:
            raise MemoryError()
        super().receive(job)

    def copy(self, job):  # type: ignore[no-untyped-def]
        if self.jobs:
            raise RuntimeError("out of memory\nin detail")
        return super().copy(job)

    def zero(self, job):  # type: ignore[no-untyped-def]
        raise OSError("zeroing failed")


class OwnErrorOnJob(Recorder):
    """Raises a BackendError of its own on job ``failing`` (1 the first) of a call."""

    name = "own-error"

    def __init__(self, failing: int) -> None:
        super().__init__()
        self.failing, self.waited = failing, []

    def receive(self, job):  # type: ignore[no-untyped-def]
        if len(self.jobs) + 1 == self.failing:
            raise kvhost.BackendError("the device is being reset")
        super().receive(job)

    def copy(self, job):  # type: ignore[no-untyped-def]
        if len(self.jobs) + 1 == self.failing:
            raise kvhost.BackendError("the device is being reset")
        super().copy(job)
        return _Tracked(self.waited, f"job{len(self.jobs)}")


@pytest.mark.parametrize("call", ["receive", "copy"])
def test_a_backend_s_own_error_goes_as_it_is_before_any_job_ran_and_is_told_apart_after(call):
    """Before any job of the call ran, the backend's own KVHostError is the caller's, the
    same object; after one ran it is wrapped, naming what ran. A copy's issued jobs are
    waited for first (their buffers go once they are done)."""
    caches = {
        "l0": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12)),
        "l1": make_cache("KBNHC", "KBHNC", dict(SIZES, B=12)),
    }
    dst = {name: torch.zeros_like(t) for name, t in caches.items()}

    def run(backend):
        if call == "copy":
            return kvhost.copy_blocks(caches, dst, [1, 2], [3, 4], axes="KBNHC", backend=backend)
        return kvhost.receive(
            caches, {"a": [0, 1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=backend
        )

    first = OwnErrorOnJob(1)
    with pytest.raises(kvhost.BackendError, match=r"^the device is being reset$"):
        run(first)
    assert first.jobs == [] and first.waited == []
    second = OwnErrorOnJob(2)
    with pytest.raises(
        kvhost.BackendError, match=f"^backend 'own-error' failed in job 2 of 2 of a {call}: BackendError: "
    ):
        run(second)
    assert len(second.jobs) == 1 and second.waited == (["job1"] if call == "copy" else [])


def test_a_failure_names_eight_requests_and_counts_the_rest():
    caches = {"l0": make_cache("KBNHC", "KBNHC", dict(SIZES, B=24))}
    requests = {f"r{i}": [2 * i, 2 * i + 1] for i in range(9)}
    with pytest.raises(kvhost.BackendError) as caught:
        kvhost.receive(
            caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=PluginFailures("receive")
        )
    names = ", ".join(f"request 'r{i}'" for i in range(8))
    assert str(caught.value).endswith(f"{names} and 1 more (layers ['l0']) may be rearranged in part")
    with pytest.raises(kvhost.BackendError) as caught:
        kvhost.receive(caches, {k: requests[k] for k in list(requests)[:8]}, axes="KBNHC", remote_order="HNC",
                       remote_block_size=4, backend=PluginFailures("receive"))  # fmt: skip
    assert str(caught.value).endswith(f"{names} (layers ['l0']) may be rearranged in part")


def test_a_receive_that_fails_after_a_job_ran_names_the_requests_rearranged_and_those_in_doubt():
    """A request rearranged must not be received again (it would be scrambled): the error
    names them, the requests of the failing job, and nothing else; a copy's says a retry
    is safe; a failure zeroing tails says every request was rearranged."""
    caches = {
        "l0": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12)),
        "l1": make_cache("KBNHC", "KBHNC", dict(SIZES, B=12)),
    }
    requests = {"a": [0, 1], "b": kvhost.Incoming([2, 3], "HNC", 8), "c": [4, 5]}
    backend = FailsOnItsSecondJob()
    with pytest.raises(kvhost.BackendError) as caught:
        kvhost.receive(caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=backend)
    assert str(caught.value) == (
        "backend 'fails-second' failed in job 2 of 3 of a receive: MemoryError; request 'a', request 'c' "
        "(layers ['l0']) were rearranged before it (do not receive them again); request 'a', request 'c' "
        "(layers ['l1']) may be rearranged in part"
    )
    assert len(backend.jobs) == 1
    backend = FailsOnItsSecondJob()
    dst = {name: torch.zeros_like(t) for name, t in caches.items()}
    with pytest.raises(
        kvhost.BackendError, match=r"in job 2 of 2 of a copy: RuntimeError: out of memory; the jobs before"
    ):
        kvhost.copy_blocks(caches, dst, [1, 2], [3, 4], axes="KBNHC", backend=backend)
    backend = FailsOnItsSecondJob()
    partial = {"a": kvhost.Incoming([0, 1], "NHC", 8, tokens=12)}
    with pytest.raises(
        kvhost.BackendError,
        match=r"failed zeroing the ends of blocks that arrived in part: OSError: zeroing failed; every block",
    ):
        kvhost.receive({"l0": caches["l0"]}, partial, axes="KBNHC", backend=backend)


def test_caches_that_moved_are_told_before_any_backend_refusal(target):
    """Memory first: a registered cache re-pointed since registration is the error a call
    gets, whatever its backend would have said of the batch."""
    if target.device == "xla":
        pytest.skip("XLA tensors have no address to re-point")
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(SIZES, B=12), device=target.device)}
    backend = RefusesTheLastGroup(groups=1)
    host = kvhost.KVHost(caches, axes="KBNHC", backend=backend)
    caches["l"].set_(caches["l"].clone())
    with pytest.raises(kvhost.LayoutError, match="changed since it was registered"):
        host.receive({"a": [1, 2]}, remote_order="HNC", remote_block_size=8)
    assert backend.checked == 0


def test_a_job_s_repr_leaves_out_what_backends_keep_and_a_job_equals_itself_alone():
    """What a backend keeps on a job (tables, scratch: tensors of megabytes) stays out of its
    repr; a job is one call's work, so it equals itself only, however alike two are."""
    from kvhost.batch import plan_receive_batch
    from kvhost.caches import CacheSet

    cache_set = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES)}, "KBNHC")
    (job,) = plan_receive_batch(cache_set, {"r": [1, 2]}, "HNC", 4).jobs
    job.derived["tables"], job.shared["scratch"] = "kept for the call", "shared by the call"
    text = repr(job)
    assert "unit_ids=" in text and "derived" not in text and "kept for" not in text and "shared" not in text
    (twin,) = plan_receive_batch(cache_set, {"r": [1, 2]}, "HNC", 4).jobs
    twin.derived["tables"], twin.shared["scratch"] = job.derived["tables"], job.shared["scratch"]
    assert job == job and job != twin and len({job, twin}) == 2


def test_the_receive_oracle_refuses_a_request_of_part_of_a_sender_block():
    """The oracle sends whole sender blocks, as a sender does: ids that are part of one (a
    plugin author's first try) are a RequestError saying so, not torch's error from inside."""
    case = ReceiveCase({"l": make_cache("KBNHC", "KBNHC", SIZES)}, "KBNHC", seed=1)  # blocks of 8 tokens
    before = case.snapshot()
    with pytest.raises(kvhost.RequestError, match=r"request 'r': 3 block ids are not whole sender blocks.* spans 2"):
        case.send("r", [1, 2, 3], "HNC", 16)
    with pytest.raises(kvhost.RequestError, match=r"block sizes 8 \(local\) and 3 \(remote\) do not divide"):
        case.send("r", [1], "HNC", 3)
    assert case.same_as(before) and not case.requests
    case.send("r", [1, 2], "HNC", 16)
    kvhost.receive(case.caches, {"r": kvhost.Incoming([1, 2], "HNC", 16)}, axes="KBNHC")
    case.check()
