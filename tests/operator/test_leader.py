"""Lease leader election, one algorithm round at a time, against an in-memory Lease API that enforces
optimistic concurrency like the API server (a patch with a stale resourceVersion gets 409) and a fake clock.
e2e/operator/test_hardening_e2e.py runs two real operator processes against kmock."""

from __future__ import annotations

import copy

import pytest

from kvserve.operator import kube, leader


class FakeLeaseAPI:
    def __init__(self):
        self.lease: dict | None = None
        self.version = 0
        self.writes: list[str] = []

    def get(self, kind, namespace, name):
        assert (kind, namespace, name) == ("Lease", "ops", "kvserve-operator")
        return copy.deepcopy(self.lease)

    def request(self, method, url_path, body=None, **_):
        self.writes.append(f"{method} {body['spec']['holderIdentity']}")
        if method == "POST":
            if self.lease is not None:
                raise kube.KubeError(409, "AlreadyExists")
        else:
            assert method == "PATCH" and url_path.endswith("/leases/kvserve-operator")
            if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
                raise kube.KubeError(409, "Conflict: the object has been modified")
        self.version += 1
        self.lease = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return copy.deepcopy(self.lease)


@pytest.fixture()
def api(monkeypatch):
    fake = FakeLeaseAPI()
    monkeypatch.setattr(kube, "get", fake.get)
    monkeypatch.setattr(kube, "request", fake.request)
    yield fake
    leader._leading = None


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _elector(identity, clock):
    return leader.Elector(
        leader.LeaseSettings(
            name="kvserve-operator",
            namespace="ops",
            identity=identity,
            lease_duration_s=15,
            renew_deadline_s=10,
            retry_period_s=2,
        ),
        clock,
    )


def test_one_leader_renews_and_a_standby_waits_for_expiry(api):
    clock = Clock()
    a, b = _elector("a", clock), _elector("b", clock)
    assert a.try_acquire_or_renew() is True and leader.may_write()
    assert b.try_acquire_or_renew() is False and api.lease["spec"]["holderIdentity"] == "a"
    for _ in range(20):  # a renews every 2 s for 40 s: b never gets in
        clock.t += 2
        assert a.try_acquire_or_renew() is True
        assert b.try_acquire_or_renew() is False
    # a dies. b saw a's last renewal just now; it takes over once 15 s pass on its own clock, not before.
    clock.t += 14.9
    assert b.try_acquire_or_renew() is False
    clock.t += 0.2
    assert b.try_acquire_or_renew() is True
    assert api.lease["spec"]["holderIdentity"] == "b" and api.lease["spec"]["leaseTransitions"] == 1
    # a comes back (e.g. after a partition): it sees b's fresh record and stands by.
    assert a.try_acquire_or_renew() is False and not a.leading


def test_a_stale_write_loses_the_race(api):
    clock = Clock()
    a, b = _elector("a", clock), _elector("b", clock)
    assert a.try_acquire_or_renew()
    a.release()
    assert api.lease["spec"]["holderIdentity"] == ""
    # Both see the released Lease; b writes first, a's PUT carries the old resourceVersion and gets 409.
    stale = copy.deepcopy(api.lease)
    assert b.try_acquire_or_renew() is True
    real_get = api.get
    api.get = lambda *args: stale if args[0] == "Lease" else real_get(*args)
    kube.get = api.get
    assert a.try_acquire_or_renew() is False
    assert api.lease["spec"]["holderIdentity"] == "b"


def test_release_hands_over_at_the_next_poll(api):
    clock = Clock()
    a, b = _elector("a", clock), _elector("b", clock)
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    a.release()
    assert not a.leading and not leader.may_write()
    assert b.try_acquire_or_renew() is True  # no waiting for expiry
    b.release()
    b.release()  # idempotent, and never clears someone else's hold
    c = _elector("c", clock)
    assert c.try_acquire_or_renew()
    a.leading = True
    a.release()
    assert api.lease["spec"]["holderIdentity"] == "c"


def test_settings_are_checked_and_the_bound_is_stated():
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        leader.LeaseSettings(name="l", namespace="n", identity="i", lease_duration_s=5, renew_deadline_s=6)
    s = leader.LeaseSettings(name="l", namespace="n", identity="i")
    assert s.takeover_bound_s == 19.0
    assert leader.may_write()  # without an election in the process, writes are allowed


class ScriptedElector:
    """Stands in for Elector in the renew loop: each round returns (or raises) the next scripted outcome."""

    def __init__(self, outcomes, then, holder):
        self.settings = leader.LeaseSettings(
            name="l", namespace="n", identity="me", lease_duration_s=2, renew_deadline_s=0.3, retry_period_s=0.05
        )
        self.outcomes, self.then, self.holder, self.rounds, self.leading = list(outcomes), then, holder, 0, True

    def try_acquire_or_renew(self):
        self.rounds += 1
        outcome = self.outcomes.pop(0) if self.outcomes else self.then
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _set(self, leading):
        self.leading = leading
        leader._leading = leading


def _run_renewer(elector, timeout=5.0):
    import asyncio
    import time

    async def main():
        lost = asyncio.Event()
        task = asyncio.create_task(leader._keep_renewing(elector, lost))
        start = time.monotonic()
        await asyncio.wait_for(lost.wait(), timeout)
        task.cancel()
        return time.monotonic() - start

    try:
        return asyncio.run(main())
    finally:
        leader._leading = None


def test_the_leader_stops_at_once_when_someone_else_holds_the_lease():
    elector = ScriptedElector([True, True, False], then=False, holder="other")
    elapsed = _run_renewer(elector)
    assert elector.rounds == 3 and not elector.leading and elapsed < 0.3


def test_the_leader_stops_after_the_renew_deadline_when_the_api_is_unreachable():
    elector = ScriptedElector([True], then=kube.KubeError(503, "unavailable"), holder="me")
    elapsed = _run_renewer(elector)
    # Kept trying through transient errors, gave up once 0.3 s passed without a renewal (< the 2 s lease).
    assert elector.rounds >= 3 and not elector.leading and 0.3 <= elapsed < 2.0
