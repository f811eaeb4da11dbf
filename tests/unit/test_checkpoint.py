"""The checkpoint format in one process: checksums recorded per rank and merged, damage named file by file,
the newest completed checkpoint first, and the mesh record's checks."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.io import checkpoint_files as checkpoint

STAGES, REPLICAS = 2, 2
RECORD = {
    "pipeline_stages": STAGES,
    "num_replicas": REPLICAS,
    "layer_ranges": [[0, 2], [2, 4]],
    "outer_optimizer": "noloco",
    "adapter": None,
}


def _mesh(rank: int, stages: int = STAGES, replicas: int = REPLICAS) -> PipelineMesh:
    # A real mesh object, without process groups: the file-level functions read only its shape and rank.
    return PipelineMesh(rank, stages * replicas, stages, replicas, None, None, torch.device("cpu"))


def _write_checkpoint(folder) -> None:
    """What write_checkpoint leaves, without the collectives: every rank's files and records, then the
    merge."""
    os.makedirs(folder)
    for rank in range(STAGES * REPLICAS):
        mesh = _mesh(rank)
        rank_dir = checkpoint.rank_folder(str(folder), mesh)
        os.makedirs(rank_dir)
        for name in ("model.safetensors", "optimizer.pt", "pipeline.pt"):
            with open(os.path.join(rank_dir, name), "wb") as f:
                f.write(os.urandom(1000 + 10 * rank))
        with open(os.path.join(folder, f"rng_state_{rank}.pth"), "wb") as f:
            f.write(b"rng" * (rank + 1))
        checkpoint.write_rank_checksums(str(folder), mesh, [f"rng_state_{rank}.pth"])
    (folder / "trainer_state.json").write_text("{}")
    checkpoint.write_mesh_record(str(folder), RECORD)
    ranks = [
        checkpoint.rank_folder_of(str(folder), r % STAGES, r // STAGES) for r in range(STAGES * REPLICAS)
    ]
    checkpoint.write_checksums(str(folder), ranks)


def test_file_checksum_is_the_sha256_and_size(tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)  # more than one read chunk
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert checkpoint.file_checksum(str(path)) == {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_the_merged_record_lists_every_file_once(tmp_path):
    folder = tmp_path / "checkpoint-4"
    _write_checkpoint(folder)
    listed = json.loads((folder / checkpoint.CHECKSUMS).read_text())["files"]
    on_disk = {
        os.path.relpath(os.path.join(root, n), folder)
        for root, _, names in os.walk(folder)
        for n in names
        if n not in (checkpoint.CHECKSUMS, checkpoint.RANK_CHECKSUMS)
    }
    assert set(listed) == on_disk
    for rel, record in listed.items():
        assert record == checkpoint.file_checksum(str(folder / rel)), rel
    for rank in range(STAGES * REPLICAS):
        assert checkpoint.verify_rank_files(str(folder), _mesh(rank)) is None


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            "truncate",
            r"stage-1-replica-0/model.safetensors: \d+ bytes, the checksum record says \d+ \(truncated\)",
        ),
        ("extend", r"model.safetensors: \d+ bytes, the checksum record says \d+ \(longer than written\)"),
        ("flip", r"model.safetensors: its SHA-256 differs from the checksum record"),
        ("delete", r"stage-1-replica-0/model.safetensors is missing"),
    ],
)
def test_damage_is_named_by_the_rank_that_reads_the_file(tmp_path, damage, expected):
    folder = tmp_path / "checkpoint-8"
    _write_checkpoint(folder)
    path = folder / "stage-1-replica-0" / "model.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "extend":
        path.write_bytes(data + b"x")
    elif damage == "flip":
        data[500] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    owner = _mesh(checkpoint_rank := 1)  # rank 1 = stage 1, replica 0: its own file
    assert checkpoint_rank == owner.rank
    import re

    assert re.search(expected, checkpoint.verify_rank_files(str(folder), owner))
    assert checkpoint.verify_rank_files(str(folder), _mesh(2)) is None  # another rank's files are intact


def test_a_damaged_shared_file_is_seen_by_every_rank(tmp_path):
    folder = tmp_path / "checkpoint-8"
    _write_checkpoint(folder)
    (folder / "trainer_state.json").write_text('{"changed": 1}')
    for rank in range(STAGES * REPLICAS):
        assert "trainer_state.json" in checkpoint.verify_rank_files(str(folder), _mesh(rank))


def test_a_checkpoint_without_its_record_or_with_a_missing_folder_is_refused(tmp_path):
    folder = tmp_path / "checkpoint-8"
    _write_checkpoint(folder)
    (folder / checkpoint.CHECKSUMS).write_text("not json")
    assert "is unreadable" in checkpoint.verify_rank_files(str(folder), _mesh(0))
    (folder / checkpoint.CHECKSUMS).unlink()
    assert "is missing (the checkpoint was written without checksums)" in checkpoint.verify_rank_files(
        str(folder), _mesh(0)
    )
    other = tmp_path / "checkpoint-9"
    _write_checkpoint(other)
    record = json.loads((other / checkpoint.CHECKSUMS).read_text())
    record["files"] = {n: v for n, v in record["files"].items() if not n.startswith("stage-1-replica-1")}
    (other / checkpoint.CHECKSUMS).write_text(json.dumps(record))
    assert checkpoint.verify_rank_files(str(other), _mesh(3)) == (
        f"checkpoint-9 holds no {os.path.join('stage-1-replica-1', 'model.safetensors')}, which "
        f"{_mesh(3).describe()} reads: the checkpoint is incomplete"
    )


def _damage(folder, rel) -> None:
    path = folder / rel
    path.write_bytes(path.read_bytes()[:-1])


@pytest.mark.parametrize("known_split", [True, False], ids=["split-known", "mesh-only"])
def test_on_another_mesh_a_rank_checks_the_files_it_reads_of_other_folders(tmp_path, known_split):
    """pp2 x dp2 -> pp1 x dp4: rank r reads both saved stages of replica r % 2 (its pipeline state from the
    first), and names damage there; replicas 0 and 2 read nothing of replica 1."""
    folder = tmp_path / "checkpoint-8"
    _write_checkpoint(folder)
    ranges = [[0, 4]] if known_split else None
    meshes = [_mesh(r, stages=1, replicas=4) for r in range(4)]
    reads = checkpoint.files_read(str(folder), meshes[3], ranges)
    names = ("model.safetensors", "optimizer.pt")
    expected = [os.path.join(f"stage-{s}-replica-1", n) for s in range(2) for n in names]
    assert reads == expected + [os.path.join("stage-0-replica-1", "pipeline.pt")]
    assert all(checkpoint.verify_rank_files(str(folder), m, ranges) is None for m in meshes)
    _damage(folder, os.path.join("stage-1-replica-1", "optimizer.pt"))
    verdicts = [checkpoint.verify_rank_files(str(folder), m, ranges) for m in meshes]
    assert verdicts[0] is None and verdicts[2] is None
    for verdict in verdicts[1::2]:
        assert (
            "checkpoint-8/stage-1-replica-1/optimizer.pt: 1029 bytes, the checksum record says 1030"
            in verdict
        )
    # Damage only the saved mesh's rank would see is not read on the new one: stage 1's pipeline state.
    _write_checkpoint(other := tmp_path / "checkpoint-9")
    _damage(other, os.path.join("stage-1-replica-1", "pipeline.pt"))
    assert all(checkpoint.verify_rank_files(str(other), m, [[0, 4]]) is None for m in meshes)
    assert "stage-1-replica-1/pipeline.pt" in checkpoint.verify_rank_files(str(other), _mesh(3))


def test_a_checkpoint_written_after_a_loss_is_read_from_its_live_replicas(tmp_path):
    folder = tmp_path / "checkpoint-8"
    _write_checkpoint(folder)
    for stage in range(STAGES):
        shutil.rmtree(folder / f"stage-{stage}-replica-0")
    checkpoint.write_mesh_record(str(folder), dict(RECORD, live_replicas=[1]))
    ranks = [checkpoint.rank_folder_of(str(folder), s, 1) for s in range(STAGES)]
    checkpoint.write_checksums(str(folder), ranks)
    reduced = [_mesh(s, replicas=1) for s in range(STAGES)]  # dp 1: the live replica, renumbered 0
    assert checkpoint.files_read(str(folder), reduced[1])[0] == os.path.join(
        "stage-1-replica-1", "model.safetensors"
    )
    assert all(checkpoint.verify_rank_files(str(folder), m) is None for m in reduced)
    full = [_mesh(r) for r in range(STAGES * REPLICAS)]  # back onto both: replica 0 copies 1
    assert all(checkpoint.verify_rank_files(str(folder), m) is None for m in full)
    _damage(folder, os.path.join("stage-0-replica-1", "model.safetensors"))
    assert [
        "stage-0-replica-1/model.safetensors" in (v or "")
        for v in (checkpoint.verify_rank_files(str(folder), m) for m in full)
    ] == [True, False, True, False]


def test_completed_checkpoints_newest_first_and_only_completed(tmp_path):
    for name in (
        "checkpoint-8",
        "checkpoint-16",
        "checkpoint-100",
        "tmp-checkpoint-120",
        "skipped-checkpoint-90",
    ):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-x").mkdir()
    found = [os.path.basename(p) for p in checkpoint.completed_checkpoints(str(tmp_path))]
    assert found == ["checkpoint-100", "checkpoint-16", "checkpoint-8"]
    assert checkpoint.completed_checkpoints(str(tmp_path / "absent")) == []
    assert checkpoint.checkpoints_in(str(tmp_path)) and not checkpoint.checkpoints_in(
        str(tmp_path / "absent")
    )


def test_moving_aside_never_overwrites(tmp_path):
    for _ in range(3):
        (tmp_path / "checkpoint-8").mkdir()
        checkpoint._move_aside(str(tmp_path / "checkpoint-8"))
    assert sorted(os.listdir(tmp_path)) == [
        "skipped-checkpoint-8",
        "skipped-checkpoint-8.1",
        "skipped-checkpoint-8.2",
    ]


def test_the_mesh_record_refuses_what_cannot_continue_the_run_and_not_another_mesh(tmp_path):
    model = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 48, "tie_word_embeddings": False}
    record = dict(RECORD, model=model)
    checkpoint.write_mesh_record(str(tmp_path), dict(record, live_replicas=[0]))
    for change in [
        dict(layer_ranges=[(0, 2), (2, 4)]),  # tuples read as lists
        dict(pipeline_stages=1, layer_ranges=[(0, 4)]),
        dict(pipeline_stages=2, layer_ranges=[[0, 3], [3, 4]], num_replicas=5),
        dict(
            model={k: v for k, v in model.items() if k != "hidden_size"}
        ),  # a setting not recorded: not checked
    ]:
        assert checkpoint.check_mesh_record(str(tmp_path), dict(record, **change))["live_replicas"] == [0]
    for change, message in [
        (
            dict(outer_optimizer="diloco"),
            r"saved with outer_optimizer=noloco, this run has diloco, and its slow",
        ),
        (dict(adapter={"r": 8}), r"saved with adapter=None, this run has \{'r': 8\}"),
        (dict(layer_ranges=[[0, 3], [3, 6]]), "saved from a model of 4 decoder layers, this run's has 6"),
        (
            dict(model=dict(model, hidden_size=64)),
            "saved from a model with hidden_size=48, this run's has 64",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            checkpoint.check_mesh_record(str(tmp_path), dict(record, **change))
