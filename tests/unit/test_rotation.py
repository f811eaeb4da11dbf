"""Which checkpoints a save keeps, rule by rule, on folders in one process; and how a folder is published (an
old copy of the same step swapped out, never half deleted). The crash test of whole saves is
tests/e2e/test_save_crash.py."""

import json
import os

import pytest

from hf_noloco.io import checkpoint_files as checkpoint


def _checkpoint(run_dir, step: int, complete: bool = True, payload: bytes = b"w" * 64) -> str:
    """A checkpoint folder as far as rotation looks: its checksum record and the files it lists."""
    folder = os.path.join(run_dir, f"checkpoint-{step}")
    os.makedirs(folder)
    files = {"trainer_state.json": json.dumps({"global_step": step}).encode()}
    files[checkpoint.MESH_FILE] = b"{}"
    files["stage-0-replica-0/model.safetensors"] = payload
    record = {}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, rel)), exist_ok=True)
        with open(os.path.join(folder, rel), "wb") as f:
            f.write(data)
        record[rel] = checkpoint.file_checksum(os.path.join(folder, rel))
    if not complete:  # cut short after its record was written: a file shorter than recorded
        with open(os.path.join(folder, "stage-0-replica-0/model.safetensors"), "wb") as f:
            f.write(payload[:10])
    with open(os.path.join(folder, checkpoint.CHECKSUMS), "w") as f:
        json.dump({"files": record}, f)
    return folder


def _names(run_dir) -> list[str]:
    return sorted(n for n in os.listdir(run_dir))


def test_the_limit_deletes_the_oldest_and_keeps_the_one_just_written(tmp_path):
    for step in (2, 4, 6, 8):
        _checkpoint(tmp_path, step)
    removed = checkpoint.rotate(str(tmp_path), str(tmp_path / "checkpoint-8"), save_total_limit=2)
    assert sorted(os.path.basename(r) for r in removed) == ["checkpoint-2", "checkpoint-4"]
    assert _names(tmp_path) == ["checkpoint-6", "checkpoint-8"]
    # No limit (or a limit below 1): nothing goes.
    assert checkpoint.rotate(str(tmp_path), str(tmp_path / "checkpoint-8"), None) == []
    assert checkpoint.rotate(str(tmp_path), str(tmp_path / "checkpoint-8"), 0) == []
    assert _names(tmp_path) == ["checkpoint-6", "checkpoint-8"]


def test_after_a_rollback_newer_checkpoints_are_moved_aside_not_picked_nor_deleted(tmp_path):
    """The run resumed checkpoint-4 by path and has now written checkpoint-6: the old trajectory's 8 and 10
    would be kept by a highest-step rule (and picked by a later `auto` resume) while the new ones went."""
    for step in (4, 6, 8, 10):
        _checkpoint(tmp_path, step)
    checkpoint.rotate(str(tmp_path), str(tmp_path / "checkpoint-6"), save_total_limit=1)
    assert _names(tmp_path) == ["abandoned-checkpoint-10", "abandoned-checkpoint-8", "checkpoint-6"]
    assert checkpoint.completed_checkpoints(str(tmp_path)) == [str(tmp_path / "checkpoint-6")]


def test_a_just_written_checkpoint_that_fails_its_check_keeps_the_newest_complete_one(tmp_path):
    for step in (2, 4):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 6, complete=False)
    assert checkpoint.complete(str(tmp_path / "checkpoint-4"))
    assert not checkpoint.complete(str(tmp_path / "checkpoint-6"))
    checkpoint.rotate(str(tmp_path), str(tmp_path / "checkpoint-6"), save_total_limit=1)
    # The limit is exceeded rather than lose the newest intact checkpoint (nor the one just written).
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-6"]


def test_the_best_checkpoint_is_kept(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    best = str(tmp_path / "checkpoint-2")
    checkpoint.rotate(
        str(tmp_path), str(tmp_path / "checkpoint-6"), save_total_limit=1, best_model_checkpoint=best
    )
    assert _names(tmp_path) == ["checkpoint-2", "checkpoint-6"]


def test_a_checkpoint_without_its_record_or_a_file_is_not_complete(tmp_path):
    folder = _checkpoint(tmp_path, 2)
    os.remove(os.path.join(folder, "stage-0-replica-0/model.safetensors"))
    assert not checkpoint.complete(folder)
    folder = _checkpoint(tmp_path, 4)
    os.remove(os.path.join(folder, checkpoint.CHECKSUMS))
    assert not checkpoint.complete(folder)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "aside"])
def test_publishing_over_an_old_copy_of_the_step_replaces_it_whole(tmp_path, monkeypatch, exchange):
    old = _checkpoint(tmp_path, 4, payload=b"old" * 30)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    tmp = _checkpoint(new_dir, 4, payload=b"new" * 30)
    staged = str(tmp_path / "tmp-checkpoint-4")
    os.replace(tmp, staged)
    if not exchange:
        monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    checkpoint.publish_folder(staged, old)
    with open(os.path.join(old, "stage-0-replica-0/model.safetensors"), "rb") as f:
        assert f.read() == b"new" * 30
    assert checkpoint.complete(old)
    assert _names(tmp_path) == ["checkpoint-4", "new"]  # nothing left aside


def test_what_a_cut_save_left_is_removed_and_checkpoints_are_not(tmp_path):
    _checkpoint(tmp_path, 2)
    for leftover in ("tmp-checkpoint-4", "tmp-removed-checkpoint-2", "tmp-removed-abandoned-checkpoint-8"):
        os.makedirs(tmp_path / leftover / "stage-0-replica-0")
    (tmp_path / "skipped-checkpoint-3").mkdir()  # a damaged checkpoint a resume moved aside: kept
    checkpoint.remove_leftovers(str(tmp_path))
    assert _names(tmp_path) == ["checkpoint-2", "skipped-checkpoint-3"]
