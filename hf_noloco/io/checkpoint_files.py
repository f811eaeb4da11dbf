"""Checkpoints of a NoLoCo run: every rank's stage replica, written so that a checkpoint is complete or
absent.

Layout of ``output_dir/checkpoint-N/``::

    noloco_mesh.json                  the mesh the run had (stages, replicas, layer split, method, routing)
    trainer_state.json, scheduler.pt  the Trainer's own state (written by rank 0)
    rng_state_<rank>.pth              each rank's random state (the Trainer's format)
    stage-<s>-replica-<r>/            one folder per rank:
        model.safetensors             the stage replica's weights (only the adapters, for a LoRA run)
        optimizer.pt                  inner + outer optimizer state (plain tensors and numbers)
        pipeline.pt                   the routing counters and tokens seen
        checksums.json                this rank's files (its folder and its RNG state): size and SHA-256
    noloco_checksums.json             every file of the checkpoint, size and SHA-256 (written last, by rank 0)

``optimizer.pt`` also records the names of its parameters (``"param_names"``), so that a resume onto another
stage split finds each tensor's optimizer state by name (:mod:`hf_noloco.io.reshard` says which folders a rank
of another mesh reads, :mod:`hf_noloco.io.regather` gathers them).

Every rank writes into ``tmp-checkpoint-N/``; rank 0 renames it to ``checkpoint-N/`` only once every rank is
done, so a crash during a save leaves the previous checkpoint the newest. Everything is read back with
safetensors or ``torch.load(weights_only=True)``: no pickled code.

A folder that was renamed can still be damaged later (a full disk, a node dying mid-copy, a flipped bit). So
each rank hashes the files it wrote, rank 0 merges those records with its own files' into
``noloco_checksums.json``, and a resume checks every file it reads against that record before any rank trains
(:func:`agreed_problems`): every rank reaches the same verdict. :func:`resolve_resume` takes the newest
checkpoint that passes, naming each file that made it skip a newer one. On another mesh a rank checks the
files it reads of other ranks' folders (:func:`files_read`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_noloco.engine.comm import peer_call
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.structured import all_gather_json, broadcast_json
from hf_noloco.io import reshard

logger = logging.getLogger(__name__)

MESH_FILE = "noloco_mesh.json"
CHECKSUMS = "noloco_checksums.json"  # the completed checkpoint's record of all its files
RANK_CHECKSUMS = "checksums.json"  # one rank's record of its own files, in its folder
SKIPPED_PREFIX = "skipped-"  # a damaged checkpoint moved aside by a resume (kept for inspection)
_WEIGHTS, _OPTIMIZER, _PIPELINE = "model.safetensors", "optimizer.pt", "pipeline.pt"
_FILES = {reshard.WEIGHTS: _WEIGHTS, reshard.OPTIMIZER: _OPTIMIZER, reshard.PIPELINE: _PIPELINE}
# Files of the whole run that every resume reads (written by rank 0 with the Trainer's state).
_SHARED_FILES = (MESH_FILE, "trainer_state.json")
_HASH_CHUNK = 1 << 20
# What a resume must share with the run that saved. The mesh (stages, split, replicas) may change
# (io/reshard.py); another method's or adapter's state would be loaded into the wrong places, or be none.
_MUST_MATCH = ("outer_optimizer", "adapter")
_SAME_SETTING = {
    "outer_optimizer": "its slow weights and momentum are that method's (start a new run to change it)",
    "adapter": "its adapter tensors are those of that LoRA configuration",
}


def rank_folder(checkpoint: str, mesh: PipelineMesh) -> str:
    return rank_folder_of(checkpoint, mesh.stage, mesh.replica)


def rank_folder_of(checkpoint: str, stage: int, replica: int) -> str:
    return os.path.join(checkpoint, f"stage-{stage}-replica-{replica}")


def checkpoints_in(folder: str) -> bool:
    """Whether ``folder`` holds completed checkpoints of a run."""
    return os.path.isdir(folder) and any(
        n.startswith(f"{PREFIX_CHECKPOINT_DIR}-") for n in os.listdir(folder)
    )


def completed_checkpoints(folder: str) -> list[str]:
    """The completed checkpoints in ``folder`` (``checkpoint-<step>``), newest (highest step) first."""
    if not os.path.isdir(folder):
        return []
    steps = [
        int(m.group(1))
        for n in os.listdir(folder)
        if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", n))
    ]
    return [os.path.join(folder, f"{PREFIX_CHECKPOINT_DIR}-{s}") for s in sorted(steps, reverse=True)]


def write_checkpoint(
    run_dir: str,
    step: int,
    mesh: PipelineMesh,
    write_rank_state: Callable[[str], Iterable[str] | None],
    write_shared_state: Callable[[str], None],
    timeout: float,
    save_total_limit: int | None = None,
    best_model_checkpoint: str | None = None,
    barrier: Callable[[], None] | None = None,
) -> str:
    """Writes ``run_dir/checkpoint-<step>`` atomically. Collective: every rank calls it.

    Args:
        run_dir: the run's output folder.
        step: the global step, which names the checkpoint.
        mesh: the process mesh.
        write_rank_state: called on every rank with the temporary checkpoint folder; writes this rank's files
            (its rank folder) and returns the names of any it wrote beside the folder (its RNG state).
        write_shared_state: called on rank 0 once every rank has written; writes the files of the whole run.
        timeout: seconds rank 0 waits for the others (a monitored barrier names the ranks that did not
        arrive). save_total_limit: the Trainer's limit on kept checkpoints.
        best_model_checkpoint: the checkpoint of the best ``metric_for_best_model``, which the limit keeps.
        barrier: how the ranks wait for each other (default: the live ranks' process group; the trainer's
            store barrier under ``on_replica_loss="continue"``, which a lost rank interrupts).

    Returns:
        The completed checkpoint's folder.
    """
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    ranks, group = mesh.live_ranks(), mesh.world_group  # every rank, unless replicas were lost
    custom_barrier = barrier is not None
    if barrier is None:

        def barrier():
            with peer_call(f"{mesh.describe()}: a checkpoint barrier"):
                dist.barrier(group=group)

    final, tmp = os.path.join(run_dir, name), os.path.join(run_dir, f"tmp-{name}")
    if mesh.is_leader:
        remove_leftovers(run_dir)
        os.makedirs(tmp)
    barrier()
    own_files = list(write_rank_state(tmp) or [])
    sync_rank_files(tmp, mesh, own_files)  # on disk before they are hashed and the folder renamed
    write_rank_checksums(tmp, mesh, own_files)
    # Rank 0 renames the folder only when every rank has written its part. A monitored barrier (gloo) names
    # the ranks that did not get there; rank 0 then fails, and the others with it.
    if custom_barrier:
        barrier()
    elif dist.get_backend() == "gloo":
        with peer_call("the checkpoint's barrier and verdicts"):
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    else:
        barrier()
    if mesh.is_leader:
        write_shared_state(tmp)
        for entry in os.listdir(tmp):
            if os.path.isfile(os.path.join(tmp, entry)):
                fsync_path(os.path.join(tmp, entry))
        write_checksums(tmp, [rank_folder_of(tmp, r % mesh.num_stages, r // mesh.num_stages) for r in ranks])
        fsync_path(tmp)
    barrier()
    if mesh.is_leader:
        publish_folder(tmp, final)
        rotate(run_dir, final, save_total_limit, best_model_checkpoint)
    barrier()
    return final


# ------------------------------------------------------------------------------------------- durability

_REMOVED_PREFIX = "tmp-removed-"  # a checkpoint being deleted: renamed first, so it is never half there
ABANDONED_PREFIX = "abandoned-"  # a checkpoint newer than the run's step (after a rollback): kept aside


def fsync_path(path: str) -> None:
    """Forces a file's data, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_rank_files(checkpoint: str, mesh: PipelineMesh, own_files: Iterable[str] = ()) -> None:
    """Every file this rank wrote into ``checkpoint`` (its rank folder, ``own_files`` beside it) on disk, and
    the folders that name them."""
    rank_dir = rank_folder(checkpoint, mesh)
    for name in os.listdir(rank_dir):
        fsync_path(os.path.join(rank_dir, name))
    for name in own_files:
        fsync_path(os.path.join(checkpoint, name))
    fsync_path(rank_dir)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not
    available."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def publish_folder(tmp: str, final: str) -> None:
    """Renames the completed ``tmp`` to ``final``. An existing ``final`` (the same step saved again) is
    swapped out in one step where the system can (Linux), else renamed aside first, and only then deleted:
    ``final`` is never missing nor half deleted while an old copy of it is all there is."""
    parent = os.path.dirname(final)
    if not os.path.exists(final):
        os.replace(tmp, final)
    elif _exchange(tmp, final):
        _remove(tmp)
    else:
        aside = os.path.join(parent, _REMOVED_PREFIX + os.path.basename(final))
        _remove(aside)
        os.replace(final, aside)
        os.replace(tmp, final)
        _remove(aside)
    fsync_path(parent)


def _remove(folder: str) -> None:
    """Deletes ``folder``: renamed first (atomically out of every listing), then removed."""
    if not os.path.exists(folder):
        return
    parent, name = os.path.split(os.path.normpath(folder))
    doomed = folder if name.startswith(_REMOVED_PREFIX) else os.path.join(parent, _REMOVED_PREFIX + name)
    if doomed != folder:
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(run_dir: str) -> None:
    """What a save or a deletion cut short left behind (``tmp-checkpoint-N``, ``tmp-removed-...``): never a
    checkpoint (a save completes by its rename)."""
    for name in os.listdir(run_dir):
        if re.fullmatch(rf"tmp-({PREFIX_CHECKPOINT_DIR}-\d+|{_REMOVED_PREFIX[4:]}.+)", name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def step_of(checkpoint: str) -> int:
    return int(os.path.basename(os.path.normpath(checkpoint)).rsplit("-", 1)[1])


def complete(checkpoint: str) -> bool:
    """Whether ``checkpoint`` holds its checksum record and every file the record lists, at its recorded
    size: what rotation checks (cheap); a resume also checks each file's SHA-256 (:func:`resolve_resume`)."""
    listed, problem = _listed_files(checkpoint)
    if problem:
        return False
    for rel, expected in listed.items():
        path = os.path.join(checkpoint, rel)
        if not isinstance(expected, dict) or not os.path.isfile(path):
            return False
        if os.path.getsize(path) != expected.get("bytes"):
            return False
    return all(rel in listed for rel in _SHARED_FILES)


def rotate(
    run_dir: str, written: str, save_total_limit: int | None, best_model_checkpoint: str | None = None
) -> list[str]:
    """After ``written`` was saved: the checkpoints that go, by these rules (returns those deleted).

    - A checkpoint of a higher step than ``written`` comes from a trajectory the run left (it resumed an
      older checkpoint): it is moved aside to ``abandoned-checkpoint-N``, never deleted, so that a later
      ``auto`` resume cannot pick it.
    - ``save_total_limit`` (``None`` or below 1: no limit) keeps that many checkpoints, deleting the oldest
      first, but never ``written``, never the newest complete one (``written`` itself unless it failed its
      check, :func:`complete`), and never ``best_model_checkpoint``.
    """
    step = step_of(written)
    removed: list[str] = []
    for folder in completed_checkpoints(run_dir):
        if step_of(folder) > step:
            target = os.path.join(run_dir, ABANDONED_PREFIX + os.path.basename(folder))
            _remove(target)
            os.replace(folder, target)
            logger.warning(
                "%s is newer than %s, the checkpoint just written: it belongs to a trajectory this run left, "
                "and is moved aside to %s.",
                folder,
                os.path.basename(written),
                os.path.basename(target),
            )
    checkpoints = completed_checkpoints(run_dir)  # newest first
    if not save_total_limit or save_total_limit < 1 or len(checkpoints) <= save_total_limit:
        return removed
    protected = {os.path.normpath(written)}
    if best_model_checkpoint:
        protected.add(os.path.normpath(best_model_checkpoint))
    newest_complete = next((c for c in checkpoints if complete(c)), None)
    if newest_complete is not None:
        protected.add(os.path.normpath(newest_complete))
    if newest_complete != written:
        logger.warning(
            "%s failed its completeness check after it was written: %s is kept.", written, newest_complete
        )
    keep = max(save_total_limit, len(protected & {os.path.normpath(c) for c in checkpoints}))
    remaining = len(checkpoints)
    for folder in reversed(checkpoints):  # the oldest first
        if remaining <= keep:
            break
        if os.path.normpath(folder) not in protected:
            _remove(folder)
            removed.append(folder)
            remaining -= 1
    fsync_path(run_dir)
    return removed


def rank_weights(stage: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a rank folder keeps of ``stage``, on the CPU. With ``trainable_only`` only the parameters
    that train (LoRA adapters): the frozen base comes from the base model again."""
    if trainable_only:
        return {k: p.detach().contiguous().cpu() for k, p in stage.named_parameters() if p.requires_grad}
    aliases = _aliases(stage)  # a tied weight held by one stage: stored once, under its first name
    return {k: v.detach().contiguous().cpu() for k, v in stage.state_dict().items() if k not in aliases}


def save_rank_files(
    folder: str, mesh: PipelineMesh, weights: dict, optimizer_state: dict, pipeline_state: dict
) -> None:
    """Writes this rank's folder of checkpoint ``folder``: its stage replica's weights (:func:`rank_weights`),
    optimizer state and pipeline counters (and the stream position)."""
    rank_dir = rank_folder(folder, mesh)
    os.makedirs(rank_dir, exist_ok=True)
    save_file({k: v.cpu() for k, v in weights.items()}, os.path.join(rank_dir, _WEIGHTS))
    torch.save(optimizer_state, os.path.join(rank_dir, _OPTIMIZER))
    torch.save(pipeline_state, os.path.join(rank_dir, _PIPELINE))


def write_mesh_record(folder: str, record: dict) -> None:
    with open(os.path.join(folder, MESH_FILE), "w") as f:
        json.dump(record, f, indent=2)


def read_mesh_record(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, MESH_FILE)) as f:
        return json.load(f)


def check_mesh_record(checkpoint: str, record: dict) -> dict:
    """Refuses to resume ``checkpoint`` into a run that cannot continue it: another outer optimizer, another
    adapter configuration, another model (another number of decoder layers, or another value of a model
    setting the record keeps). Another mesh is not refused: :mod:`hf_noloco.io.reshard`. Returns the saved
    record."""
    saved = read_mesh_record(checkpoint)
    for key in _MUST_MATCH:
        if saved.get(key) != json.loads(json.dumps(record.get(key))):  # JSON has lists where we have tuples
            raise ValueError(
                f"Cannot resume {checkpoint}: it was saved with {key}={saved.get(key)}, this run has "
                f"{record.get(key)}, and {_SAME_SETTING[key]}. Resume with {key}={saved.get(key)} (the "
                "mesh may change: pipeline_stages, stage split, number of processes)."
            )
    saved_layers, layers = saved["layer_ranges"][-1][1], record["layer_ranges"][-1][1]
    if saved_layers != layers:
        raise ValueError(
            f"Cannot resume {checkpoint}: it was saved from a model of {saved_layers} decoder layers, this "
            f"run's has {layers}: another model."
        )
    mine = record.get("model") or {}
    for key, value in (saved.get("model") or {}).items():
        if key in mine and mine[key] != value:
            raise ValueError(
                f"Cannot resume {checkpoint}: it was saved from a model with {key}={value}, this run's has "
                f"{mine[key]}: another model."
            )
    return saved


def load_rank_state(
    checkpoint: str, mesh: PipelineMesh, stage: nn.Module, trainable_only: bool = False
) -> dict:
    """Loads this rank's weights into ``stage`` (with ``trainable_only``: exactly its trainable parameters);
    returns its pipeline counters."""
    rank_dir = rank_folder(checkpoint, mesh)
    weights = load_file(os.path.join(rank_dir, _WEIGHTS))
    if trainable_only:
        expected = {name for name, p in stage.named_parameters() if p.requires_grad}
        if set(weights) != expected:
            raise ValueError(
                f"Cannot resume {checkpoint}: its adapter tensors do not match this run's "
                f"({sorted(set(weights) ^ expected)[:3]} differ)."
            )
    _load_weights(checkpoint, stage, weights, trainable_only)
    return torch.load(os.path.join(rank_dir, _PIPELINE), weights_only=True)


def _load_weights(checkpoint: str, stage: nn.Module, weights: dict, trainable_only: bool) -> None:
    missing, unexpected = stage.load_state_dict(weights, strict=False)
    if trainable_only:
        return  # the frozen base is all that is missing; the names were checked
    missing = sorted(set(missing) - _aliases(stage))
    if unexpected or missing:
        raise ValueError(
            f"Cannot resume {checkpoint}: its weights do not match this stage's (missing {missing[:3]}, "
            f"unexpected {sorted(unexpected)[:3]})."
        )


def load_weights_by_name(
    checkpoint: str,
    stage: nn.Module,
    source: Callable[[str], tuple[int, int, str]],
    trainable_only: bool = False,
) -> None:
    """Loads ``stage``'s tensors (with ``trainable_only``: its trainable ones) from the rank folders that hold
    them: ``source(name)`` is ``(saved stage, saved replica, saved name)``. Only those tensors are read."""
    if trainable_only:
        names = [n for n, p in stage.named_parameters() if p.requires_grad]
    else:
        names = [n for n in stage.state_dict() if n not in _aliases(stage)]
    wanted: dict[tuple[int, int], dict[str, str]] = {}
    for name in names:
        saved_stage, saved_replica, saved_name = source(name)
        wanted.setdefault((saved_stage, saved_replica), {})[name] = saved_name
    weights = {}
    for (saved_stage, saved_replica), names_there in sorted(wanted.items()):
        rel = plan_file(saved_stage, saved_replica, reshard.WEIGHTS)
        with safe_open(os.path.join(checkpoint, rel), framework="pt") as f:
            held = set(f.keys())
            for name, saved_name in names_there.items():
                if saved_name not in held:
                    raise ValueError(
                        f"Cannot resume {checkpoint}: {rel} holds no {saved_name} (this stage's {name})."
                    )
                weights[name] = f.get_tensor(saved_name)
    _load_weights(checkpoint, stage, weights, trainable_only)


def read_rank_file(checkpoint: str, stage: int, replica: int, kind: str) -> dict:
    """A rank folder's optimizer or pipeline state (plain tensors and numbers, read with ``weights_only``)."""
    path = os.path.join(checkpoint, plan_file(stage, replica, kind))
    return torch.load(path, weights_only=True, map_location="cpu")


def _aliases(stage: nn.Module) -> set[str]:
    """State-dict names that are another name of a tensor already listed (``lm_head.weight`` of a tied model
    whose stage holds both ends): safetensors stores a tensor once."""
    seen, aliases = {}, set()
    for name, tensor in stage.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
        if key in seen and tensor.numel():
            aliases.add(name)
        seen.setdefault(key, name)
    return aliases


def load_optimizer_state(checkpoint: str, mesh: PipelineMesh) -> dict:
    return torch.load(
        os.path.join(rank_folder(checkpoint, mesh), _OPTIMIZER), weights_only=True, map_location="cpu"
    )


# ------------------------------------------------------------------------------------------- checksums


def file_checksum(path: str) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of a file, read in 1 MiB chunks (bounded memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _write_json_atomically(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_path(os.path.dirname(path) or ".")


def write_rank_checksums(checkpoint: str, mesh: PipelineMesh, own_files: Iterable[str] = ()) -> None:
    """Records the size and SHA-256 of this rank's files (its rank folder, plus ``own_files`` beside it) in
    ``<rank folder>/checksums.json``. The files are hashed as they lie on disk once written: what a resume
    will read."""
    rank_dir = rank_folder(checkpoint, mesh)
    names = [os.path.relpath(os.path.join(rank_dir, n), checkpoint) for n in sorted(os.listdir(rank_dir))]
    names = [n for n in names if os.path.basename(n) != RANK_CHECKSUMS] + list(own_files)
    record = {n: file_checksum(os.path.join(checkpoint, n)) for n in names}
    _write_json_atomically(os.path.join(rank_dir, RANK_CHECKSUMS), {"files": record})


def write_checksums(checkpoint: str, rank_dirs: Iterable[str]) -> None:
    """Rank 0, once every rank has written: merges the ranks' records and adds every other file of the
    checkpoint (the run's shared state), hashed here, into ``noloco_checksums.json``."""
    files: dict[str, dict] = {}
    for rank_dir in rank_dirs:
        path = os.path.join(rank_dir, RANK_CHECKSUMS)
        if not os.path.isfile(path):  # the barrier before us says every rank has written its part
            raise RuntimeError(f"{path} is missing: a rank did not record its checkpoint files.")
        with open(path) as f:
            files.update(json.load(f)["files"])
    for root, _, names in os.walk(checkpoint):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), checkpoint)
            if rel not in files and name not in (RANK_CHECKSUMS, CHECKSUMS):
                files[rel] = file_checksum(os.path.join(checkpoint, rel))
    _write_json_atomically(os.path.join(checkpoint, CHECKSUMS), {"files": files})


def plan_file(stage: int, replica: int, kind: str) -> str:
    """The path, relative to the checkpoint, of a rank folder's file of ``kind`` (a kind of
    :mod:`~hf_noloco.io.reshard`)."""
    return os.path.join(f"stage-{stage}-replica-{replica}", _FILES[kind])


def files_read(checkpoint: str, mesh: PipelineMesh, layer_ranges=None) -> list[str]:
    """The files of the rank folders that this rank reads from ``checkpoint`` (paths relative to it): its own
    folder's on the mesh that wrote it, otherwise those :func:`~hf_noloco.io.reshard.read_plan` names.
    ``layer_ranges``: this run's stage split. Without it (a caller that knows only the mesh) the rank names,
    for the saved replica it takes, the saved stage of its own index when the number of stages is the same,
    else every saved stage: a rank may then read a stage another rank names instead, but the verdicts are
    shared (:func:`agreed_problems`) and together name every file any rank reads. Reads the mesh record."""
    return _reads(reshard.SavedMesh.of(read_mesh_record(checkpoint)), mesh, layer_ranges)[0]


def _reads(saved: reshard.SavedMesh, mesh: PipelineMesh, layer_ranges) -> tuple[list[str], bool]:
    """:func:`files_read`, and whether the mesh is the one that wrote the checkpoint."""
    if saved.same_as(mesh.num_stages, mesh.num_replicas, layer_ranges):
        return [plan_file(mesh.stage, mesh.replica, kind) for kind in _FILES], True
    plan = reshard.read_plan(
        saved, mesh.stage, mesh.replica, mesh.num_stages, mesh.num_replicas, layer_ranges
    )
    return [plan_file(*f) for f in plan.files()], False


def files_to_verify(
    checkpoint: str, mesh: PipelineMesh, listed: Iterable[str], layer_ranges=None
) -> list[str]:
    """The files of ``listed`` that this rank checks: everything beside the rank folders (small: the run's
    state and the RNG states) and the rank folders' files it reads (:func:`files_read`): on the mesh that
    wrote the checkpoint, its own folder, so that every file is checked by at least one rank."""
    reads, same = _reads(reshard.SavedMesh.of(read_mesh_record(checkpoint)), mesh, layer_ranges)
    own = os.path.relpath(rank_folder(checkpoint, mesh), checkpoint) + os.sep
    return [n for n in listed if (n.startswith(own) if same else n in reads) or os.sep not in n]


def _listed_files(checkpoint: str) -> tuple[dict | None, str | None]:
    """``(the checksum record's files, None)``, or ``(None, what is wrong with the record)``."""
    name = os.path.basename(os.path.normpath(checkpoint))
    record_path = os.path.join(checkpoint, CHECKSUMS)
    if not os.path.isfile(record_path):
        return None, f"{name}/{CHECKSUMS} is missing (the checkpoint was written without checksums)"
    try:
        with open(record_path) as f:
            listed = json.load(f)["files"]
        if not isinstance(listed, dict):
            raise TypeError(type(listed).__name__)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return None, f"{name}/{CHECKSUMS} is unreadable ({type(exc).__name__}: {exc})"
    return listed, None


def recorded_files(checkpoint: str) -> list[str] | None:
    """Every file of ``checkpoint`` its record lists, with the records themselves (what an upload of the
    checkpoint sends); ``None`` when it has no readable record."""
    listed, problem = _listed_files(checkpoint)
    if problem:
        return None
    records = [CHECKSUMS]
    for rel in listed:
        own = os.path.join(os.path.dirname(rel), RANK_CHECKSUMS)
        if os.path.dirname(rel) and os.path.isfile(os.path.join(checkpoint, own)):
            records.append(own)
    return sorted(set(listed) | set(records))


def _check_files(checkpoint: str, listed: dict, names: Iterable[str], reader: str) -> str | None:
    name = os.path.basename(os.path.normpath(checkpoint))
    for rel in names:
        if rel not in listed:
            return f"{name} holds no {rel}, which {reader} reads: the checkpoint is incomplete"
        path, expected = os.path.join(checkpoint, rel), listed[rel]
        if not os.path.isfile(path):
            return f"{name}/{rel} is missing"
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            how = "truncated" if size < expected["bytes"] else "longer than written"
            return f"{name}/{rel}: {size} bytes, the checksum record says {expected['bytes']} ({how})"
        if file_checksum(path)["sha256"] != expected["sha256"]:
            return f"{name}/{rel}: its SHA-256 differs from the checksum record (the content changed)"
    return None


def verify_rank_files(checkpoint: str, mesh: PipelineMesh, layer_ranges=None) -> str | None:
    """What is wrong with the files this rank would read from ``checkpoint``, or ``None`` when they all match
    the checkpoint's record. The answer names the file: ``checkpoint-8/stage-1-replica-1/model.safetensors:
    1024 bytes, the checksum record says 5120 (truncated)``. On another mesh the rank checks the files it
    reads of other ranks' folders (``layer_ranges``: this run's split, see :func:`files_read`)."""
    name = os.path.basename(os.path.normpath(checkpoint))
    listed, problem = _listed_files(checkpoint)
    if problem:
        return problem
    for rel in _SHARED_FILES:
        if rel not in listed:
            return f"{name}/{rel} is not in {CHECKSUMS} (the checkpoint is incomplete)"
    # The run's files first: the mesh record among them says which rank folders this rank reads.
    problem = _check_files(
        checkpoint, listed, [n for n in sorted(listed) if os.sep not in n], mesh.describe()
    )
    if problem:
        return problem
    try:
        reads = files_read(checkpoint, mesh, layer_ranges)
        checked = files_to_verify(checkpoint, mesh, sorted(listed), layer_ranges)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{name}/{MESH_FILE} cannot be read ({type(exc).__name__}: {exc})"
    missing = [rel for rel in reads if rel not in listed]
    return _check_files(checkpoint, listed, missing + [n for n in checked if os.sep in n], mesh.describe())


def agreed_problems(checkpoint: str, mesh: PipelineMesh, layer_ranges=None) -> list[str]:
    """Every rank's verdict on ``checkpoint`` (:func:`verify_rank_files`), the same list on every rank.
    Collective: every rank calls it, so no rank can start training from a checkpoint another refuses."""
    mine = verify_rank_files(checkpoint, mesh, layer_ranges)
    verdicts = all_gather_json(mine, what="the checkpoint's barrier and verdicts")
    if not all(v is None or isinstance(v, str) for v in verdicts):
        raise ValueError(f"Cannot resume {checkpoint}: a rank sent a malformed verdict.")
    return list(dict.fromkeys(v for v in verdicts if v))  # in rank order, each problem once


def resolve_resume(run_dir: str, requested: str | bool, mesh: PipelineMesh, layer_ranges=None) -> str | None:
    """The checkpoint to resume, verified on every rank; collective. ``layer_ranges``: this run's stage split,
    which tells each rank the files it reads of a checkpoint of another mesh (:func:`files_read`).

    ``requested`` is a checkpoint folder (an error naming the damaged file if it does not verify) or
    ``True``: the newest completed checkpoint in ``run_dir`` that verifies. Newer ones that do not are logged,
    naming the file, and moved aside to ``skipped-checkpoint-N`` (kept for inspection; otherwise a later save
    could rotate away the intact checkpoint in favour of the damaged one). Returns ``None`` when ``run_dir``
    holds no completed checkpoint; raises when it holds only damaged ones.
    """
    if requested is not True:
        problems = agreed_problems(requested, mesh, layer_ranges)
        if problems:
            raise ValueError(f"Cannot resume {requested}: " + "; ".join(problems))
        return requested
    # Rank 0's listing for all: ranks that saw different folders (a slow shared filesystem) would otherwise
    # call different numbers of collectives. A checkpoint a rank cannot see fails its check there.
    listing = completed_checkpoints(run_dir) if mesh.rank == 0 else None
    candidates = broadcast_json(listing, src=0, what="the checkpoint's barrier and verdicts")
    if not isinstance(candidates, list) or not all(_is_checkpoint_of(c, run_dir) for c in candidates):
        raise ValueError(f"Cannot resume from {run_dir}: rank 0 sent a malformed list of checkpoints.")
    skipped = []
    for candidate in candidates:
        problems = agreed_problems(candidate, mesh, layer_ranges)
        if not problems:
            for folder, reasons in skipped:
                logger.warning("Skipping %s: %s.", folder, "; ".join(reasons))
            if mesh.rank == 0:
                for folder, _ in skipped:
                    _move_aside(folder)
            with peer_call("the barrier after moving damaged checkpoints aside"):
                dist.barrier()
            if skipped:
                logger.warning("Resuming from %s, the newest checkpoint that verifies.", candidate)
            return candidate
        skipped.append((candidate, problems))
    if skipped:
        raise ValueError(
            f"No intact checkpoint in {run_dir}: "
            + " | ".join(f"{os.path.basename(c)}: {'; '.join(p)}" for c, p in skipped)
        )
    return None


def _is_checkpoint_of(path, run_dir: str) -> bool:
    """Whether ``path`` names a ``checkpoint-N`` folder directly inside ``run_dir``."""
    if not isinstance(path, str):
        return False
    parent, name = os.path.split(path)
    return parent == run_dir and re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", name) is not None


def _move_aside(folder: str) -> None:
    parent, name = os.path.split(os.path.normpath(folder))
    target = os.path.join(parent, SKIPPED_PREFIX + name)
    suffix = 1
    while os.path.exists(target):
        target = os.path.join(parent, f"{SKIPPED_PREFIX}{name}.{suffix}")
        suffix += 1
    os.replace(folder, target)
