"""Checkpoints resumed onto another mesh, on real gloo processes: other stage splits (ddp: the uninterrupted
run's weights and losses), other replica counts (noloco: each replica's weights and optimizer state those
of the saved replica it takes, bit for bit), and a checkpoint written after a replica loss, onto the reduced
mesh and back onto the full one."""

import json
import logging
import os
import shutil

import pytest
import torch
from transformers import TrainerCallback

from hf_noloco.io import checkpoint_files as checkpoint
from hf_noloco.launch.local_launch import run_distributed
from tests.helpers.runs import byte_config, byte_corpus, make_args


def _snapshot(trainer) -> dict:
    """This rank's weights and, by parameter name, its optimizer state: the inner optimizer's (AdamW's
    moments and step) and the outer one's (slow weights, momentum), read from the live objects."""
    outer = trainer.outer
    position = {id(p): i for i, p in enumerate(outer.params)}
    state = {}
    for name, p in trainer.model.named_parameters():
        entry = {k: v.clone() for k, v in outer.state.get(p, {}).items() if torch.is_tensor(v)}
        if outer.phi:
            entry["phi"] = outer.phi[position[id(p)]].clone()
            entry["delta"] = outer.delta[position[id(p)]].clone()
        state[name] = entry
    return {
        "weights": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": state,
        "counters": (outer.inner_step_count, outer.outer_step_count),
    }


class _AtTrainBegin(TrainerCallback):
    """The state right after a resume has loaded everything (the Trainer calls on_train_begin then)."""

    def __init__(self, trainer):
        self.trainer, self.snapshot = trainer, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.snapshot = _snapshot(self.trainer)


def _train(out, stages, method, max_steps, save_steps, resume=None, tied=False):
    from hf_noloco.trainer import NoLoCoTrainer

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("hf_noloco.components.checkpointer").addHandler(handler)
    args = make_args(
        out,
        pipeline_stages=stages,
        outer_optimizer=method,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=save_steps,
        logging_steps=1,
        eval_strategy="no",
        inner_steps=2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
    )
    trainer = NoLoCoTrainer(byte_config(tied=tied), args, train_dataset=byte_corpus(128))
    start = _AtTrainBegin(trainer)
    trainer.add_callback(start)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    result = {
        "at": (trainer.mesh.stage, trainer.mesh.replica),
        "start": start.snapshot,
        "end": _snapshot(trainer),
        "losses": {h["step"]: h["loss"] for h in history if "loss" in h},
        "lrs": {h["step"]: h["learning_rate"] for h in history if "learning_rate" in h},
        "warnings": [w for w in warnings if "onto another mesh" in w],
    }
    trainer.end()
    return result


def _replica(results: list[dict], replica: int, when: str, key: str) -> dict:
    """One replica's entries merged over its stages (a tied lm_head of a one-stage run: its embeddings)."""
    merged = {}
    for r in results:
        if r["at"][1] == replica:
            merged.update(r[when][key])
    return merged


def _copy_checkpoint(src, run_dir):
    os.makedirs(run_dir, exist_ok=True)
    shutil.copytree(src, os.path.join(run_dir, os.path.basename(src)))


@pytest.mark.parametrize(
    "before, after, tied",
    [((2, 2), (1, 2), False), ((1, 1), (3, 1), True)],
    ids=["pp2-to-pp1", "pp1-to-pp3-tied"],
)
def test_ddp_resumed_onto_another_stage_split_matches_the_uninterrupted_run(tmp_path, before, after, tied):
    """(stages, replicas) before -> after, ddp: 4 steps, a checkpoint, 4 more on the other split, against 8
    straight steps. pp2 -> pp1 also resumes a checkpoint written before optimizers recorded their parameter
    names (rebuilt from the saved split); pp1 -> pp3 splits a tied embedding into two copies."""
    stages, replicas = before
    straight = run_distributed(
        _train, stages * replicas, str(tmp_path / "a"), stages, "ddp", 8, 4, None, tied, timeout_s=120
    )
    resumed_dir = tmp_path / "b"
    _copy_checkpoint(str(tmp_path / "a" / "checkpoint-4"), resumed_dir)
    if not tied:  # as an older checkpoint: no parameter names
        _strip_parameter_names(resumed_dir / "checkpoint-4")
    stages, replicas = after
    resumed = run_distributed(
        _train, stages * replicas, str(resumed_dir), stages, "ddp", 8, 4, True, tied, timeout_s=120
    )
    # The only arithmetic that differs is the order of reductions: the column's gradient norm (clipping)
    # sums one partial sum per stage. Here that moves weights by < 1e-8 over 4 steps; 1e-6 is two orders
    # above it and three below one step's update (lr 3e-3), so a lost, doubled or misloaded step fails.
    for replica in range(replicas):
        expected, got = (_replica(runs, replica, "end", "weights") for runs in (straight, resumed))
        assert set(got) == set(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    for rank in resumed:
        losses = straight[0]["losses"]
        assert sorted(rank["losses"]) == list(range(1, 9))
        for step in range(5, 9):
            assert rank["losses"][step] == pytest.approx(losses[step], rel=1e-6), step
        assert rank["lrs"] == straight[0]["lrs"]  # the schedule carries over exactly
    assert len(resumed[0]["warnings"]) == 1 and all(not r["warnings"] for r in resumed[1:])
    assert f"{before[0]} stage" in resumed[0]["warnings"][0]
    assert f"-> {after[0]} stage" in resumed[0]["warnings"][0]


def _strip_parameter_names(folder) -> None:
    for path in folder.glob("stage-*/optimizer.pt"):
        state = torch.load(path, weights_only=True)
        del state["param_names"]
        torch.save(state, path)
        _rehash(folder, os.path.relpath(path, folder))


def _rehash(folder, *names) -> None:
    path = folder / checkpoint.CHECKSUMS
    record = json.loads(path.read_text())
    for name in names:
        record["files"][name] = checkpoint.file_checksum(str(folder / name))
    path.write_text(json.dumps(record))


def _as_after_a_loss(src, dst, live: list[int], stages: int) -> None:
    """``src`` as a checkpoint written after a replica loss: the lost replicas' folders and random states
    absent, the mesh record listing the live replicas, the checksum record the files present."""
    shutil.copytree(src, dst)
    mesh_path = dst / checkpoint.MESH_FILE
    record = json.loads(mesh_path.read_text())
    record["live_replicas"] = live
    mesh_path.write_text(json.dumps(record))
    for replica in range(record["num_replicas"]):
        if replica not in live:
            for stage in range(stages):
                shutil.rmtree(dst / f"stage-{stage}-replica-{replica}")
                (dst / f"rng_state_{replica * stages + stage}.pth").unlink()
    path = dst / checkpoint.CHECKSUMS
    listed = json.loads(path.read_text())["files"]
    listed = {n: v for n, v in listed.items() if (dst / n).exists()}
    path.write_text(json.dumps({"files": listed}))
    _rehash(dst, checkpoint.MESH_FILE)


def _assert_took(resumed: list[dict], saved: list[dict], sources: dict[int, int], saved_when="end"):
    """Right after loading, each replica r of ``resumed`` holds exactly what saved replica ``sources[r]``
    held when it saved: weights, AdamW moments and steps, slow weights and momentum, step counters."""
    for replica, source in sources.items():
        for key in ("weights", "optimizer"):
            expected, got = _replica(saved, source, saved_when, key), _replica(resumed, replica, "start", key)
            assert set(got) <= set(expected) and got, (replica, key)
            for name, value in got.items():
                if key == "weights":
                    assert torch.equal(value, expected[name]), (replica, name)
                    continue
                assert set(value) == set(expected[name]) == {"step", "exp_avg", "exp_avg_sq", "phi", "delta"}
                for part in value:
                    assert torch.equal(value[part], expected[name][part]), (replica, name, part)
    counters = {r["start"]["counters"] for r in resumed} | {r[saved_when]["counters"] for r in saved}
    assert len(counters) == 1, counters


def test_noloco_resumed_onto_more_then_fewer_replicas_takes_each_saved_replica_exactly(tmp_path):
    """noloco, dp2 x pp2 -> dp4 x pp1 (replicas 2, 3 copy 0, 1; each gathers both saved stages) -> dp2 x pp1
    (the first two continue). Then a checkpoint written after replicas 0 and 2 were lost: onto the two
    live ones (renumbered 0, 1) and back onto all four (the lost ones copied from live ones)."""
    a, b = tmp_path / "a", tmp_path / "b"
    saved = run_distributed(_train, 4, str(a), 2, "noloco", 4, 4, timeout_s=120)
    # Damage in a folder of another rank's that a rank of the new mesh reads is named before any trains.
    damaged = tmp_path / "damaged"
    _copy_checkpoint(str(a / "checkpoint-4"), damaged)
    path = damaged / "checkpoint-4" / "stage-1-replica-1" / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(
        RuntimeError, match=r"checkpoint-4/stage-1-replica-1/optimizer.pt: \d+ bytes.*\(truncated\)"
    ):
        run_distributed(_train, 4, str(damaged), 1, "noloco", 6, 6, True, timeout_s=120)
    _copy_checkpoint(str(a / "checkpoint-4"), b)
    more = run_distributed(_train, 4, str(b), 1, "noloco", 6, 6, True, timeout_s=120)
    _assert_took(more, saved, {0: 0, 1: 1, 2: 0, 3: 1})
    assert "replica 2 copies saved replica 0, 3 copies 1" in more[0]["warnings"][0]
    assert all(sorted(r["losses"]) == list(range(1, 7)) for r in more)
    # Copies start equal and go on apart: their data shards differ.
    assert not torch.equal(
        more[0]["end"]["weights"]["lm_head.weight"], more[2]["end"]["weights"]["lm_head.weight"]
    )

    c = tmp_path / "c"
    _copy_checkpoint(str(b / "checkpoint-6"), c)
    fewer = run_distributed(_train, 2, str(c), 1, "noloco", 8, 8, True, timeout_s=120)
    _assert_took(fewer, more, {0: 0, 1: 1})
    assert "saved replicas 2, 3 dropped" in fewer[0]["warnings"][0]
    assert all(sorted(r["losses"]) == list(range(1, 9)) for r in fewer)

    lost = tmp_path / "lost" / "checkpoint-6"
    _as_after_a_loss(b / "checkpoint-6", lost, live=[1, 3], stages=1)
    reduced = run_distributed(_train, 2, str(lost.parent), 1, "noloco", 8, 8, str(lost), timeout_s=120)
    _assert_took(reduced, more, {0: 1, 1: 3})
    assert "live replicas [1, 3]" in reduced[0]["warnings"][0]
    full_dir = tmp_path / "full"
    _copy_checkpoint(str(lost), full_dir)
    full = run_distributed(_train, 4, str(full_dir), 1, "noloco", 8, 8, True, timeout_s=120)
    _assert_took(full, more, {0: 1, 1: 1, 2: 3, 3: 3})
    assert all(sorted(r["losses"]) == list(range(1, 9)) for r in full)
