"""The checkpoint format in one process: checksums recorded per rank and merged, damage named file by file,
the newest completed checkpoint first, and the mesh record's checks."""

import hashlib
import json
import os

import pytest
import torch

from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.io import checkpoint

STAGES, REPLICAS = 2, 2


def _mesh(rank: int) -> PipelineMesh:
    # A real mesh object, without process groups: the file-level functions read only its shape and rank.
    return PipelineMesh(rank, STAGES * REPLICAS, STAGES, REPLICAS, None, None, torch.device("cpu"))


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
    checkpoint.write_mesh_record(str(folder), {"pipeline_stages": STAGES, "num_replicas": REPLICAS})
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


def test_a_checkpoint_without_its_record_or_of_another_mesh_is_refused(tmp_path):
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
    bigger = PipelineMesh(5, 6, STAGES, 3, None, None, torch.device("cpu"))  # replica 2 does not exist there
    assert "saved by a run with another number of processes" in checkpoint.verify_rank_files(
        str(other), bigger
    )


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


def test_the_mesh_record_refuses_what_would_load_tensors_into_the_wrong_places(tmp_path):
    record = {
        "pipeline_stages": 2,
        "num_replicas": 2,
        "layer_ranges": [[0, 2], [2, 4]],
        "outer_optimizer": "noloco",
        "adapter": None,
    }
    checkpoint.write_mesh_record(str(tmp_path), record)
    checkpoint.check_mesh_record(
        str(tmp_path), dict(record, layer_ranges=[(0, 2), (2, 4)])
    )  # tuples read as lists
    for key, value in [
        ("pipeline_stages", 4),
        ("layer_ranges", [[0, 3], [3, 4]]),
        ("outer_optimizer", "diloco"),
    ]:
        with pytest.raises(ValueError, match=f"saved with {key}="):
            checkpoint.check_mesh_record(str(tmp_path), dict(record, **{key: value}))
