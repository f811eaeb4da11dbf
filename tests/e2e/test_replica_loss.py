"""on_replica_loss="continue": a dp=4 x pp=2 NoLoCo run loses a rank of replica column 2 and trains on.

The runs are tests/fault_train.py on 8 processes forked around a store that this process hosts (no worker
hosts it, as under hf_noloco.column_launch), and one run through the real `python -m hf_noloco.column_launch`
launches. Each faulty run is compared with the uninterrupted one: identical until the fault, then the six
survivors go on to max_steps, exit 0, and export the mean of the live replicas; the lost rank's column mate
leaves with status 0.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from hf_noloco.config import NoLoCoConfig, check_replica_loss
from hf_noloco.engine.routing import Router
from hf_noloco.launch.local_launch import free_port
from hf_noloco.outer.gossip import gossip_groups, live_gossip_groups
from hf_noloco.resilience.membership import live_after_loss
from tests.helpers.fault_runs import FAULT_TRAIN, RUN_SECRET, launch

WORLD, STAGES, MAX_STEPS = 8, 2, 12  # dp = 4 replica columns of 2 stages; outer steps after steps 3, 6, 9, 12
JOIN_STEPS = 12  # a replacement column joins after the loss at step 5, and trains on
VICTIM, MATE = 5, 4  # column 2: stage 1 is lost, stage 0 must leave
SURVIVORS = [0, 1, 2, 3, 6, 7]
LIVE = [0, 1, 3]
CONTINUE = dict(
    ON_REPLICA_LOSS="continue",
    TORCHELASTIC_USE_AGENT_STORE="True",  # the workers join a store they do not host
    MAX_STEPS=str(MAX_STEPS),
    P2P_TIMEOUT="5",
    EXPORT="1",
)


# ------------------------------------------------------------------------------------- pure parts


def test_a_lost_rank_takes_its_whole_column():
    assert live_after_loss([0, 1, 2, 3], [5], num_stages=2) == [0, 1, 3]
    assert live_after_loss([0, 1, 3], [0, 7], num_stages=2) == [1]
    assert live_after_loss([0, 1, 3], [], num_stages=2) == [0, 1, 3]


def test_routing_among_live_replicas_is_a_permutation_of_them_and_unchanged_while_all_live():
    full, everyone = Router(4, "sample", seed=3), Router(4, "sample", seed=3, live=[0, 1, 2, 3])
    some = Router(4, "sample", seed=3, live=[0, 1, 3])
    drawn = set()
    for sample in range(64):
        assert everyone.permutation(0, 0, sample) == full.permutation(0, 0, sample)
        perm = some.permutation(0, 0, sample)
        assert sorted(perm[r] for r in [0, 1, 3]) == [0, 1, 3]  # live replicas send to live replicas only
        drawn.add(tuple(perm[r] for r in [0, 1, 3]))
    assert len(drawn) == 6  # every pairing of three replicas occurs
    with pytest.raises(ValueError, match="one routing group"):
        Router(4, "sample", group_size=2, live=[0, 1, 3])


def test_gossip_groups_among_live_replicas():
    for step in range(20):
        assert live_gossip_groups([0, 1, 2, 3], 2, 7, step) == gossip_groups(4, 2, 7, step)
        groups = live_gossip_groups([0, 1, 3], 2, 7, step)
        assert sorted(r for g in groups for r in g) == [0, 1, 3]  # a partition of the live replicas
        assert sorted(len(g) for g in groups) == [3]  # an odd count: one group of three
    assert live_gossip_groups([2], 2, 7, 0) == [[2]]  # alone: no partner


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(outer_optimizer="diloco"), "needs outer_optimizer 'noloco' or 'local'"),
        (dict(outer_optimizer="ddp"), "needs outer_optimizer 'noloco' or 'local'"),
        (dict(outer_overlap_steps=1), "outer_overlap_steps"),
        (dict(routing_domain="node"), "routing_domain='global'"),
        (dict(ddp_backend="nccl"), "gloo"),
        (dict(on_replica_loss="carry-on"), "on_replica_loss"),
    ],
)
def test_continue_refuses_what_it_cannot_keep(change, message):
    settings = dict(
        on_replica_loss="continue",
        outer_optimizer="noloco",
        outer_overlap_steps=0,
        routing_domain="global",
        use_cpu=True,
        ddp_backend=None,
    )
    settings.update(change)
    with pytest.raises(ValueError, match=message):
        check_replica_loss(type("Config", (), settings))


def test_continue_needs_one_launch_per_column(monkeypatch, tmp_path):
    """Under torchrun (or with rank 0 hosting the store) a lost rank takes everyone down: refused at once."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "torchrun")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ValueError, match="one launch per replica column"):
        NoLoCoConfig(output_dir=str(tmp_path), pipeline_stages=2, on_replica_loss="continue", max_steps=1)


# ---------------------------------------------------------------------------------- losing a rank


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    codes, _, logs, results = launch(out, world=WORLD, **CONTINUE)
    assert codes == [0] * WORLD, [log[-2000:] for log in logs]
    assert all(results[r]["live_replicas"] == [0, 1, 2, 3] for r in range(WORLD))
    return results


def assert_trained_on(out, codes, logs, results, uninterrupted, fault_step, victim_code, victim=VICTIM):
    """The survivors trained to max_steps on the live replicas and exported their mean; the mate left."""
    mate = victim ^ 1
    live = [c for c in range(WORLD // STAGES) if c != victim // STAGES]
    survivors = [r for r in range(WORLD) if r // STAGES in live]
    assert codes[victim] == victim_code, (codes, logs[victim][-2000:])
    assert codes[mate] == 0 and os.path.exists(out / f"dropped-rank{mate}"), (codes, logs[mate][-3000:])
    for r in survivors:
        assert codes[r] == 0, (r, codes, logs[r][-3000:])
        assert results[r]["global_step"] == MAX_STEPS
        assert results[r]["live_replicas"] == live
        assert f"view 1 in effect: live replicas {live}" in logs[r]
        losses, before = results[r]["losses"], uninterrupted[r]["losses"]
        for step in range(1, fault_step):  # the same run until the fault
            assert losses[step] == before[step], (r, step)
        assert losses[MAX_STEPS] < losses[fault_step - 1] - 0.3, losses  # and still learning after it
        assert results[r]["outer_steps"] == MAX_STEPS // 3
    # Three replicas train after the loss: fewer tokens than the uninterrupted run, more than 3/4 of them.
    for r in survivors:
        assert 0.75 < results[r]["tokens_seen"] / uninterrupted[r]["tokens_seen"] < 1
    # The export is the mean over the live replicas of each stage's final weights, written by the first stage
    # of the first live replica (rank 0 unless its column was lost).
    exported = load_file(str(out / "export" / "model.safetensors"))
    for stage in range(STAGES):
        ranks = [c * STAGES + stage for c in live]
        for name in results[ranks[0]]["weights"]:
            mean = torch.stack([results[r]["weights"][name].float() for r in ranks]).mean(0)
            torch.testing.assert_close(exported[name].float(), mean, rtol=0, atol=1e-6, msg=name)


# Rank 1: column 0 (rank 0's) is lost and rank 2 leads; the tests below lose column 2.
@pytest.mark.parametrize("victim", [1])
def test_sigkill_mid_step_drops_the_column_and_the_others_train_on(tmp_path, uninterrupted, victim):
    out = tmp_path / "run"
    codes, _, logs, results = launch(out, timeout=150, world=WORLD, FAULT=f"kill-step:5:{victim}", **CONTINUE)
    assert_trained_on(out, codes, logs, results, uninterrupted, 5, -signal.SIGKILL, victim)
    # Checkpoints go on after the loss and say which replicas they hold; the lost column has no folder.
    lost = victim // STAGES
    record = json.loads((out / "checkpoint-8" / "noloco_mesh.json").read_text())
    assert record["live_replicas"] == [c for c in range(4) if c != lost]
    assert not list((out / "checkpoint-8").glob(f"*replica-{lost}*"))


def test_sigkill_inside_the_outer_exchange(tmp_path, uninterrupted):
    """Rank 5 dies as outer step 2 (after step 6) starts exchanging: its partner averages nothing this outer
    step, everyone else as drawn."""
    out = tmp_path / "run"
    codes, _, logs, results = launch(
        out, timeout=150, world=WORLD, FAULT=f"kill-outer:6:{VICTIM}", **CONTINUE
    )
    assert_trained_on(out, codes, logs, results, uninterrupted, 6, -signal.SIGKILL)
    assert any(results[r]["skipped_outer_steps"] > 0 for r in SURVIVORS)
    assert results[0]["live_replicas"] == LIVE


def test_frozen_rank_is_dropped_after_p2p_timeout(tmp_path, uninterrupted):
    """Rank 5 is SIGSTOPped at the end of step 6, before the step's logging collectives: silent for
    p2p_timeout (5 s), its column is dropped and the others train on."""
    out = tmp_path / "run"
    started = time.monotonic()
    codes, _, logs, results = launch(out, timeout=150, world=WORLD, FAULT=f"stop-log:6:{VICTIM}", **CONTINUE)
    assert codes[VICTIM] is None  # still stopped when the others had ended; launch() then killed it
    assert_trained_on(out, codes, logs, results, uninterrupted, 6, None)
    assert time.monotonic() - started < 120


def shard_rows(replica: int, steps: int) -> dict[int, list[int]]:
    """The first row of each step's batch of ``replica``'s shard (fault_train's data, batch and seed), from
    Accelerate's loader alone: what a replica reads at each step of the first epoch."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from tests.helpers.fault_train import byte_corpus

    loader = DataLoader(byte_corpus(16 * steps), batch_size=4, shuffle=True, collate_fn=default_data_collator)
    loader = prepare_data_loader(
        loader, "cpu", num_processes=4, process_index=replica, use_seedable_sampler=True, data_seed=5
    )
    return {k + 1: batch["input_ids"][0, :8].tolist() for k, batch in zip(range(steps), loader)}


def test_a_replacement_column_joins_the_live_run_and_trains_on_with_four_replicas(tmp_path):
    """The documented launches: `python -m hf_noloco.column_launch --store-only` hosts the store and four
    column launches join it, with a fifth launch of column 0 with --join standing by. A worker of column 0
    (rank 0's column) is killed at step 5: that launch fails, the three others train on, and the stand-by is
    admitted at a step boundary: it starts from its donor's weights, bit for bit, reads its own shard from the
    run's step,
    and the run ends at max_steps with 4 live replicas whose mean is the export. Every launch but the killed
    one ends with status 0, and the store stops by itself once the workers are gone."""
    out = tmp_path / "run"
    out.mkdir()
    port = free_port()
    env = dict(os.environ, **{k: v for k, v in CONTINUE.items() if k != "TORCHELASTIC_USE_AGENT_STORE"})
    env.update(MAX_STEPS=str(JOIN_STEPS), RECORD_STEPS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["HF_NOLOCO_RUN_SECRET"] = RUN_SECRET  # every launch's (the store proves it to each worker)
    store = ["--store", f"127.0.0.1:{port}", "--columns", "4", "--stages", str(STAGES)]
    module = [sys.executable, "-m", "hf_noloco.column_launch", *store]
    commands = {"store": [*module, "--store-only", "--linger", "3"]}
    for column in range(4):
        commands[f"launch-{column}"] = [*module, "--column", str(column), FAULT_TRAIN, str(out)]
    commands["join-0"] = [*module, "--column", "0", "--join", FAULT_TRAIN, str(out)]

    def start(name, **extra):
        log = open(out / f"{name}.txt", "w")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(commands[name], env=dict(env, **extra), stdout=log, stderr=subprocess.STDOUT)
        return proc, log

    # The replacement starts with the others: a stand-by that asks at once and is admitted once the run has
    # dropped column 0 (a tiny run would be over before a replacement started after the kill is set up).
    launches = {name: start(name, FAULT="kill-step:5:1") for name in commands if name != "join-0"}
    launches["join-0"] = start("join-0")
    codes = {}
    try:
        for name, (proc, _) in launches.items():
            codes[name] = proc.wait(timeout=240)
    finally:
        for proc, log in launches.values():
            log.close()
            if proc.poll() is None:
                proc.kill()
    texts = {name: (out / f"{name}.txt").read_text(errors="replace")[-3000:] for name in launches}
    expected = {"store": 0, "join-0": 0, "launch-0": 128 + signal.SIGKILL, "launch-1": 0, "launch-2": 0}
    assert codes == dict(expected, **{"launch-3": 0}), texts
    results = {r: torch.load(out / f"result-rank{r}.pt", weights_only=True) for r in range(WORLD)}
    for r, result in results.items():
        assert result["global_step"] == JOIN_STEPS and result["live_replicas"] == [0, 1, 2, 3], r
    for stage in range(STAGES):
        [join] = results[stage]["joins"]  # the joined rank of this stage
        donor, step = join["peer"], join["step"]
        assert donor // STAGES in (1, 2, 3) and donor % STAGES == stage and 5 <= step < JOIN_STEPS - 2
        assert join["bytes"] > sum(v.numel() * v.element_size() for v in results[stage]["weights"].values())
        assert min(results[stage]["weights_at"]) == step  # its first step is the run's next one
        for name, value in results[donor]["weights_at"][step].items():
            assert torch.equal(results[stage]["weights_at"][step][name], value), name
    # Its steps read replica 0's shard from the run's step on, as the survivors read theirs.
    assert results[2]["rows"] == shard_rows(1, JOIN_STEPS)
    expected = shard_rows(0, JOIN_STEPS)
    assert results[0]["rows"] == {k: expected[k] for k in range(step + 1, JOIN_STEPS + 1)}
    exported = load_file(str(out / "export" / "model.safetensors"))
    for stage in range(STAGES):
        ranks = [c * STAGES + stage for c in range(4)]
        for name in results[ranks[0]]["weights"]:
            mean = torch.stack([results[r]["weights"][name].float() for r in ranks]).mean(0)
            torch.testing.assert_close(exported[name].float(), mean, rtol=0, atol=1e-6, msg=name)
    assert (
        "view 2 in effect: live replicas [0, 1, 2, 3] (4 of the run's columns); replicas [0] joined"
        in (out / "launch-2.txt").read_text()
    )


def test_a_lost_store_ends_every_rank_within_p2p_timeout_naming_it(tmp_path):
    """The store is the one process a "continue" run cannot lose: killed mid-step, every rank stops at its
    next fence with an error naming it (exit 1, no hang)."""
    out = tmp_path / "run"
    env = dict(CONTINUE, FAULT="kill-store:5:0")
    codes, times, logs, _ = launch(out, timeout=120, world=4, **env)
    assert codes == [1] * 4, (codes, [log[-2000:] for log in logs])
    [killed_at] = re.findall(r"SIGKILL to the store at monotonic ([0-9.]+)", logs[0]) or [logs[0][-3000:]]
    for log, ended in zip(logs, times):
        assert re.search(r"the run's store at 127\.0\.0\.1:\d+ is unreachable", log), log[-3000:]
        assert ended - float(killed_at) < float(CONTINUE["P2P_TIMEOUT"]) + 30  # noticed at once, then exit


def test_a_checkpoint_written_after_a_loss_is_accepted_for_resume(tmp_path):
    """Its record names the live replicas (a resume reshards onto them or the full mesh:
    tests/distributed/test_mesh_change.py); another outer method is still refused."""
    from hf_noloco.io.checkpoint_files import MESH_FILE, check_mesh_record

    record = {"pipeline_stages": 2, "num_replicas": 4, "layer_ranges": [[0, 2], [2, 4]]}
    record["outer_optimizer"] = "noloco"
    (tmp_path / MESH_FILE).write_text(json.dumps(dict(record, adapter=None, live_replicas=[0, 1, 3])))
    assert check_mesh_record(str(tmp_path), dict(record, adapter=None))["live_replicas"] == [0, 1, 3]
    with pytest.raises(ValueError, match="saved with outer_optimizer=noloco, this run has local"):
        check_mesh_record(str(tmp_path), dict(record, adapter=None, outer_optimizer="local"))


class _Watch:
    """What Membership reads from comm.PeerWatch: the store, the key prefix and the heartbeat interval."""

    def __init__(self, store):
        self.store, self.prefix, self.interval = store, "hf_noloco/0", 0.05


def test_members_agree_on_the_first_proposal_and_a_dropped_rank_leaves():
    """Three one-stage replicas share a store (threads stand in for processes). Rank 0 and rank 1 propose
    different next views at once; both adopt the one stored first, at the next fence, and the rank it leaves
    out raises ReplicaDropped instead of joining: no split brain."""
    import threading

    import torch.distributed as dist

    from hf_noloco.engine.comm import interrupt_waits_on
    from hf_noloco.resilience.membership import Membership, ReplicaDropped

    store = dist.HashStore()
    changes, outcome = {0: [], 1: [], 2: []}, {}
    members = {
        r: Membership(
            _Watch(store), r, 1, 3, silence=3600, on_change=lambda *a, r=r: changes[r].append(a[1]), poll=0.01
        )
        for r in range(3)
    }
    interrupt_waits_on(None)  # the three share this process's comm module: no interruption of real waits here
    try:
        for r in range(3):  # view 0: everyone meets at the first fence
            threading.Thread(target=members[r].fence).start()
        deadline = time.monotonic() + 10
        while any(m._fences < 1 for m in members.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(m._fences == 1 for m in members.values())
        won = members[1].propose([2], "rank 2 lost")  # stored first
        also = members[0].propose([1], "rank 1 lost")  # too late: rank 0 gets rank 1's proposal back
        assert won == also and won["live"] == [0, 1]

        def fence(r):
            try:
                members[r].fence()
                outcome[r] = "passed"
            except ReplicaDropped as exc:
                outcome[r] = str(exc)

        threads = [threading.Thread(target=fence, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert outcome[0] == outcome[1] == "passed"
        assert "replica 2 was dropped from the run in view 1" in outcome[2]
        assert changes[0] == changes[1] == [[0, 1]] and changes[2] == []
        assert members[0].live == members[1].live == [0, 1] and members[0].view == members[1].view == 1
    finally:
        for m in members.values():
            m.close()


def test_a_bug_that_raises_a_runtime_error_is_not_taken_for_a_lost_peer(tmp_path):
    """Lost peers are told by the error's type: a RuntimeError whose text reads like NCCL's, raised by code of
    ours during evaluation, stops the run on every rank instead of skipping the evaluation."""
    env = dict(CONTINUE, FAULT="bug-eval:2:-1", MAX_STEPS="4")
    codes, _, logs, _ = launch(tmp_path / "run", world=4, **env)
    assert codes == [1] * 4, [log[-2000:] for log in logs]
    for log in logs:
        assert "RuntimeError: CUDA error: an NCCL operation timed out (Socket closed)" in log
        assert "evaluation interrupted" not in log and "evaluation skipped" not in log
