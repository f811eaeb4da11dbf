"""The run's secret and the authenticated control plane, in one process: sealed records and what is ignored,
the store's proof (and a squatter's lack of one), the bind, the secret's file, and proposals validated by
the membership (threads stand in for ranks; an attacker is a plain store client without the secret)."""

import json
import os
import socket
import stat
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hf_noloco.engine.comm import free_port, interrupt_waits_on
from hf_noloco.resilience import authentication as auth
from hf_noloco.resilience.membership import Membership, StoreTampered, proposal_problem
from hf_noloco.resilience.run_secret import SecretError, StoreBindError, read_secret, write_secret

SECRET = b"unit-test-secret-" + b"0123456789abcdef" * 2


def test_a_sealed_record_opens_only_under_its_secret_run_and_key():
    mine = auth.RecordAuth(SECRET, "run-a")
    sealed = mine.seal("hf_noloco/0/live/view/1", '{"live": [0, 1]}')
    assert mine.open("hf_noloco/0/live/view/1", sealed) == b'{"live": [0, 1]}'
    assert mine.open("hf_noloco/0/live/view/2", sealed) is None  # moved to another key
    assert auth.RecordAuth(SECRET, "run-b").open("hf_noloco/0/live/view/1", sealed) is None  # another run
    assert auth.RecordAuth(b"x" * 40, "run-a").open("hf_noloco/0/live/view/1", sealed) is None  # no secret
    forged = sealed.replace(b"[0, 1]", b"[]")
    assert mine.open("hf_noloco/0/live/view/1", forged) is None
    assert mine.open("hf_noloco/0/live/view/1", b'{"live": []}') is None  # what an attacker writes
    assert mine.ignored["hf_noloco/0/live/view/1"] == 2 and sum(mine.ignored.values()) == 3
    # Without a secret (a test, a torchrun run without one) any record of the right form is accepted.
    assert auth.RecordAuth(None).open("k", b".payload") == b"payload"


def test_an_authenticated_store_reads_invalid_records_as_absent_and_replaces_them_in_compare_set():
    raw = dist.HashStore()
    store = auth.AuthenticatedStore(raw, auth.RecordAuth(SECRET, "run"))
    raw.set("view", b'{"live": []}')  # an attacker's record
    assert store.read("view") is None and store.read("missing") is None
    assert store.compare_set("view", "", "mine") == b"mine"  # the invalid record was replaced
    assert store.compare_set("view", "", "theirs") == b"mine"  # a valid one stays: first writer wins
    store.set("beat", "7")
    raw.set("other-beat", b"12")
    assert auth.read_counts(store, ["beat", "other-beat", "none"]) == [7, None, 0]
    raw.set("beat", raw.get("beat"))  # a replay of the same record is the same count
    assert auth.read_counts(store, ["beat"]) == [7]


def _host(secret=SECRET):
    port = free_port()
    return auth.host_run_store("127.0.0.1", port, secret), port


def test_the_store_proves_the_secret_and_a_squatter_or_another_secret_cannot():
    (store, records, stop), port = _host()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    run_id = auth.prove_store(client, lambda: SECRET, 10.0, f"127.0.0.1:{port}")
    assert len(run_id) == 32
    started = time.monotonic()
    with pytest.raises(SecretError, match="did not prove the run's secret"):
        auth.prove_store(client, lambda: b"y" * 40, 1.0, "here")
    assert time.monotonic() - started < 5
    stop.set()
    # A squatter: a plain store on the port, which knows no secret (what binds the port first).
    squat_port = free_port()
    squatter = dist.TCPStore("127.0.0.1", squat_port, is_master=True, wait_for_workers=False)
    victim = dist.TCPStore("127.0.0.1", squat_port, is_master=False, timeout=timedelta(seconds=10))
    with pytest.raises(SecretError, match="not this run's store"):
        auth.prove_store(victim, lambda: SECRET, 1.0, f"127.0.0.1:{squat_port}")
    # ... and a forged answer is no proof either.
    fake = dist.TCPStore("127.0.0.1", squat_port, is_master=False)
    threading.Timer(0.2, lambda: fake.set("hf_noloco/store-proof/answer/2", "run.deadbeef")).start()
    with pytest.raises(SecretError):
        auth.prove_store(victim, lambda: SECRET, 1.0, "here")
    del squatter


def test_the_store_listens_on_its_bind_address_only_and_a_taken_port_is_refused():
    (store, records, stop), port = _host()
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    with pytest.raises(OSError):  # another loopback address of this machine: nothing listens there
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    with pytest.raises(StoreBindError, match=f"cannot host the run's store on 127.0.0.1:{port}"):
        auth.host_run_store("127.0.0.1", port, SECRET)
    stop.set()


def test_the_secret_file_is_the_users_only(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_NOLOCO_RUN_SECRET", raising=False)
    monkeypatch.delenv("HF_NOLOCO_RUN_SECRET_FILE", raising=False)
    path = str(tmp_path / "conf" / "secret")
    write_secret(path, "s" * 64)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret(path) == (b"s" * 64, path)
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        read_secret(path)
    monkeypatch.setenv("HF_NOLOCO_RUN_SECRET", "short")
    with pytest.raises(SecretError, match="fewer than 32"):
        read_secret(path)
    monkeypatch.delenv("HF_NOLOCO_RUN_SECRET")
    assert read_secret(str(tmp_path / "none")) is None


@pytest.mark.parametrize(
    "proposal, problem",
    [
        ({"live": [], "by": 0}, "empty view"),
        ({"live": [0, 1], "by": 4}, "not in a live column"),  # rank 4 is column 2: not live before
        ({"live": [0, 1, 3], "by": 0}, "without a join"),  # column 3 appears without a join
        ({"live": [0, 2], "by": 0, "joined": [2], "at_fence": 1}, "must keep the live columns"),
        ({"live": [0, 1, 2], "by": 2, "joined": [2], "at_fence": 1}, "not by the leader"),
        ({"live": [0, 1, 2], "by": 0, "joined": [2]}, "without the fence"),
        ({"live": "all", "by": 0}, "malformed"),
        ({"live": [1, 0], "by": 0}, "unsorted"),
        ({"live": [0], "by": 2}, None),  # a loss, proposed by rank 2 (column 1)
        ({"live": [0, 1, 2], "by": 0, "joined": [2], "at_fence": 1}, None),  # a join, by the leader
    ],
)
def test_a_proposal_is_drawn_from_the_view_before_made_by_a_member_and_never_empty(proposal, problem):
    found = proposal_problem(proposal, [0, 1], num_stages=2, num_replicas=4)
    assert (found is None) if problem is None else (problem in found), found


class _Watch:
    def __init__(self, store):
        self.store, self.prefix, self.interval = store, "hf_noloco/0", 0.05


def test_forged_records_are_ignored_and_a_replaced_view_is_caught(monkeypatch):
    """Three one-stage members share a store with the secret; an attacker without it writes an empty view,
    fence arrivals and heartbeats. Nobody goes offline or leaves for them; a real proposal replaces the
    forged view and everyone adopts it at the same fence; a rank whose heartbeat was only replayed is
    silent; and a valid view record replaced under the members' feet is caught when they meet."""
    monkeypatch.setattr(auth, "_RUN", auth.RecordAuth(SECRET, "run"))
    raw = dist.HashStore()
    changes = {0: [], 1: [], 2: []}
    members = {
        r: Membership(
            _Watch(raw), r, 1, 3, silence=3600, on_change=lambda *a, r=r: changes[r].append(a[1]), poll=0.01
        )
        for r in range(3)
    }
    interrupt_waits_on(None)
    try:
        raw.set("hf_noloco/0/live/view/1", json.dumps({"live": [], "by": 0}))  # attack: an empty view
        raw.set("hf_noloco/0/live/fence/0/0/2", "view-0")  # attack: rank 2 "arrived" at the first fence
        time.sleep(0.2)
        assert not any(m.offline for m in members.values())  # the forged view was not adopted
        done = []
        for r in (0, 1):
            threading.Thread(target=lambda r=r: (members[r].fence(), done.append(r))).start()
        time.sleep(0.3)
        assert done == []  # rank 2's forged arrival does not let the others pass
        members[2].fence()
        deadline = time.monotonic() + 5
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(done) == [0, 1]
        assert members[0].store.auth.ignored["hf_noloco/0/live/view/1"] >= 1
        # A heartbeat replayed (the count of the record as it was) never moves, nor does one without a MAC.
        members[2].store.set("hf_noloco/0/beat/2", "5")
        members[1].store.set("hf_noloco/0/beat/1", "3")
        record = raw.get("hf_noloco/0/beat/2")
        assert members[0].silent_ranks(0.1) == []  # first reads: the counts as they are now
        time.sleep(0.15)
        raw.set("hf_noloco/0/beat/2", record)  # attack: rank 2's last record, again
        raw.set("hf_noloco/0/beat/1", b"999")  # attack: a higher count, without a MAC
        assert members[0].silent_ranks(0.1) == [1, 2]
        members[1].store.set("hf_noloco/0/beat/1", "4")  # rank 1 beats again: alive
        assert members[0].silent_ranks(0.1) == [2]
        # A real loss: rank 1 proposes; its proposal replaces the forged one; all adopt it at one fence.
        won = members[1].propose([2], "rank 2 lost")
        assert won["live"] == [0, 1]
        outcome = {}

        def fence(r):
            try:
                members[r].fence()
                outcome[r] = "passed"
            except Exception as exc:  # noqa: BLE001 - ReplicaDropped for rank 2
                outcome[r] = type(exc).__name__

        threads = [threading.Thread(target=fence, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert outcome == {0: "passed", 1: "passed", 2: "ReplicaDropped"}
        assert changes[0] == changes[1] == [[0, 1]]
        # A valid view replaced between two members' reads (only an overwrite of the store can do it): they
        # adopted different views, and find it when they next meet.
        members[0]._views[1] = dict(members[0]._views[1], reason="another")
        caught = []

        def meet(r):
            try:
                members[r].fence()
            except StoreTampered:
                caught.append(r)

        threads = [threading.Thread(target=meet, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert caught, "the two views went unnoticed"
    finally:
        for m in members.values():
            m.close()


def test_a_column_launch_without_the_secret_or_on_a_taken_port_is_one_error_line(
    tmp_path, monkeypatch, capsys
):
    from hf_noloco.launch import column_launch

    monkeypatch.delenv("HF_NOLOCO_RUN_SECRET", raising=False)
    monkeypatch.delenv("HF_NOLOCO_RUN_SECRET_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    port = free_port()
    store = ["--store", f"127.0.0.1:{port}", "--columns", "2", "--stages", "1"]
    assert column_launch.main([*store, "--column", "1", "--start-timeout", "0.3", "worker.py"]) == 2
    err = capsys.readouterr().err
    assert f"no secret for the run's store at 127.0.0.1:{port}" in err and f"run-secret-{port}" in err
    squatter = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    assert column_launch.main([*store, "--store-only"]) == 2
    assert f"cannot host the run's store on 127.0.0.1:{port}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "hf_noloco" / f"run-secret-{port}")  # nothing written: not bound
    del squatter
    args = column_launch.parse_args([*store, "--store-only"])
    assert (args.bind, args.secret_file) == ("127.0.0.1", str(tmp_path / "hf_noloco" / f"run-secret-{port}"))
    assert column_launch.parse_args([*store, "--store-only", "--bind", "::"]).bind == "::"


def test_the_store_only_host_waits_for_a_real_heartbeat_not_a_forged_one():
    """Once, one fake heartbeat and silence made `--store-only` stop before any worker came."""
    from hf_noloco.launch.column_launch import serve_until_idle

    (store, records, stop), port = _host()
    attacker = dist.TCPStore("127.0.0.1", port, is_master=False)
    attacker.add("hf_noloco/0/beat/0", 1)  # what the heartbeats once were: a counter
    attacker.set("hf_noloco/0/beat/1", f"{'0' * 64}.7")
    started = time.monotonic()
    assert serve_until_idle(records, 2, linger=0.2, start_timeout=1.0) is False  # no worker ever beat
    assert time.monotonic() - started >= 1.0
    worker = auth.AuthenticatedStore(dist.TCPStore("127.0.0.1", port, is_master=False), records.auth)
    worker.set("hf_noloco/0/beat/1", "1")  # a real worker's first beat, then silence
    assert serve_until_idle(records, 2, linger=0.3, start_timeout=5.0) is True
    stop.set()
