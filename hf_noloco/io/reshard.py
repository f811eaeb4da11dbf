"""Which saved folders each rank of another mesh reads, and what it takes from them: the rules of resuming a
checkpoint with other stage boundaries, another ``pipeline_stages``, another number of replicas, or after a
replica loss. Pure: no files, no tensors, no communication.

A checkpoint holds one folder per (stage, replica) of the mesh that wrote it
(:mod:`hf_noloco.io.checkpoint_files`). Rank (stage ``s``, replica ``r``) of another mesh takes

- **its replica** from one saved replica (:func:`replica_sources`). Replicas are never averaged: under NoLoCo
  each is a model of its own, whose weights, inner optimizer moments, slow weights and outer momentum belong
  together, and a mean of Adam moments is no replica's state. With as many replicas as the checkpoint holds
  or fewer, the first ones continue (renumbered in order after a loss: live ``[1, 3]`` onto two replicas
  become 0 and 1); with more, every saved replica below the new count keeps its index and each other index
  copies a saved replica in turn (replica ``r`` copies ``r % old`` when none was lost).
- **its tensors** by name from the saved stages that hold them (:func:`tensor_owner`; stages keep Hugging
  Face's names): a decoder layer from the stage whose range holds its index, the embeddings from the first
  stage, the final norm and ``lm_head`` from the last. A tied ``lm_head`` that the new last stage needs from
  a one-stage checkpoint, which stored the matrix once, is the embedding matrix: the two copies of a tied
  matrix are bit-identical and take the same optimizer steps (:mod:`hf_noloco.engine.tied`), so either
  copy's state is the other's. When one saved stage holds exactly the new stage's tensors (same layers, same
  ends) its files load as they are (:attr:`ReadPlan.as_saved`).
- **its pipeline state** (routing counters, token counts, the stream position) from the first stage of its
  saved replica: the counters are the same on every rank, and the first stage reads the stream.

Why not ``torch.distributed.checkpoint``: it reshards the *shards of one tensor* between ranks by name. Here
the replicas are not shards but distinct copies under the same names (it would need one name per replica and
a planner choosing which copy each rank reads, which is this module's job anyway), and the per-rank layout
has what its files lack: plain safetensors weights any tool reads, ``weights_only`` loading, per-file
checksums that every rank verifies before any trains, and the atomic rename. Reading a saved stage's tensors
by name (``safetensors.safe_open``) is all that resharding needs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

WEIGHTS, OPTIMIZER, PIPELINE = "weights", "optimizer", "pipeline"  # the files of a rank folder, by kind

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_FIRST_STAGE = ("model.embed_tokens.",)
_LAST_STAGE = ("model.norm.", "lm_head.")
_TIED_HEAD, _EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"


@dataclass(frozen=True)
class SavedMesh:
    """The mesh a checkpoint was written by, from its mesh record."""

    stages: int
    replicas: int
    layer_ranges: tuple[tuple[int, int], ...]
    held: tuple[int, ...]  # the replicas with folders: all of them, or the live ones after a loss

    @classmethod
    def of(cls, record: dict) -> SavedMesh:
        live = record.get("live_replicas")
        held = range(record["num_replicas"]) if live is None else sorted(live)
        ranges = tuple((int(a), int(b)) for a, b in record["layer_ranges"])
        return cls(int(record["pipeline_stages"]), int(record["num_replicas"]), ranges, tuple(held))

    def same_as(self, stages: int, replicas: int, layer_ranges: Sequence[Sequence[int]] | None) -> bool:
        """Whether a run of ``stages`` x ``replicas`` with ``layer_ranges`` (``None``: the saved ones) is
        this mesh, with every replica held: then each rank reads its own folder, as written."""
        ranges = self.layer_ranges if layer_ranges is None else tuple(tuple(r) for r in layer_ranges)
        return (
            (stages, replicas) == (self.stages, self.replicas)
            and ranges == self.layer_ranges
            and self.held == tuple(range(self.replicas))
        )


def replica_sources(held: Sequence[int], num_replicas: int) -> list[tuple[int, bool]]:
    """For each replica of a mesh of ``num_replicas``: ``(the saved replica it takes, whether it continues
    it)``. A replica that does not continue its source copies it (another new replica continues the same
    one). See the module's docstring for the rule."""
    held = sorted(held)
    if not held:
        raise ValueError("The checkpoint holds no replica.")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    if num_replicas <= len(held):
        return [(q, True) for q in held[:num_replicas]]
    kept = {q for q in held if q < num_replicas}
    # Those beyond the new count continue before any is copied: no saved replica is dropped for a copy.
    turns = [q for q in held if q not in kept]
    sources, k = [], 0
    for r in range(num_replicas):
        if r in kept:
            sources.append((r, True))
            continue
        continues = k < len(turns)
        sources.append((turns[k] if continues else held[(k - len(turns)) % len(held)], continues))
        k += 1
    return sources


def tensor_owner(name: str, layer_ranges: Sequence[Sequence[int]], tied: bool = False) -> tuple[int, str]:
    """``(saved stage, saved name)`` of the tensor a new stage holds as ``name``, in a checkpoint split at
    ``layer_ranges``; ``tied``: the model ties its embeddings."""
    last = len(layer_ranges) - 1
    match = _LAYER.match(name)
    if match:
        layer = int(match.group(1))
        for stage, (start, end) in enumerate(layer_ranges):
            if start <= layer < end:
                return stage, name
        raise ValueError(
            f"{name}: layer {layer} is in none of the saved stages' layers {list(layer_ranges)}."
        )
    if name.startswith(_FIRST_STAGE):
        return 0, name
    if name.startswith(_LAST_STAGE):
        if tied and last == 0 and name == _TIED_HEAD:
            return 0, _EMBEDDINGS  # one stage stored the tied matrix once, under its first name
        return last, name
    raise ValueError(
        f"No rule says which saved stage holds {name!r} (stages hold model.embed_tokens, model.layers.<i>, "
        "model.norm and lm_head)."
    )


@dataclass(frozen=True)
class ReadPlan:
    """What one rank of a new mesh reads from a checkpoint of another."""

    replica: int  # the saved replica it takes
    continues: bool  # it continues that replica (False: it copies one another new replica continues)
    stages: tuple[int, ...]  # the saved stages whose weights and optimizer state it reads
    as_saved: bool  # ``stages`` is one stage holding exactly this stage's tensors: its files load as written
    carries_stream: bool  # its data shard is the saved replica's, so a stream position carries over

    def files(self) -> list[tuple[int, int, str]]:
        """``(saved stage, saved replica, kind)`` of every file it reads (kinds: WEIGHTS, OPTIMIZER,
        PIPELINE)."""
        tensors = [(s, self.replica, kind) for s in self.stages for kind in (WEIGHTS, OPTIMIZER)]
        return tensors + [(0, self.replica, PIPELINE)]


def read_plan(
    saved: SavedMesh,
    stage: int,
    replica: int,
    num_stages: int,
    num_replicas: int,
    layer_ranges: Sequence[Sequence[int]] | None = None,
) -> ReadPlan:
    """What rank (``stage``, ``replica``) of a ``num_stages`` x ``num_replicas`` mesh split at
    ``layer_ranges`` reads of a checkpoint of ``saved``.

    Without ``layer_ranges`` (a caller that knows only the mesh): with as many stages as the checkpoint,
    its split is assumed; with another number, every saved stage of the replica may hold a tensor of this
    one, and all are named. Either way the plans of all ranks together name every file that any rank reads
    under any split, since each names its saved replica's stages by its own index or all of them."""
    source, continues = replica_sources(saved.held, num_replicas)[replica]
    carries = num_replicas == saved.replicas and source == replica
    if layer_ranges is None:
        if num_stages != saved.stages:
            return ReadPlan(source, continues, tuple(range(saved.stages)), False, carries)
        layer_ranges = saved.layer_ranges
    if len(layer_ranges) != num_stages:
        raise ValueError(f"{num_stages} stages but {len(layer_ranges)} layer ranges: {list(layer_ranges)}.")
    start, end = layer_ranges[stage]
    first, last = stage == 0, stage == num_stages - 1
    saved_last = saved.stages - 1
    for s, saved_range in enumerate(saved.layer_ranges):
        if saved_range == (start, end) and (s == 0) == first and (s == saved_last) == last:
            return ReadPlan(source, continues, (s,), True, carries)
    stages = {s for s, (a, b) in enumerate(saved.layer_ranges) if a < end and start < b}
    stages |= {0} if first else set()
    stages |= {saved_last} if last else set()
    return ReadPlan(source, continues, tuple(sorted(stages)), False, carries)


def _shape(stages: int, replicas: int, layer_ranges: Sequence[Sequence[int]]) -> str:
    return (
        f"{stages} stage{'s' if stages != 1 else ''} x {replicas} replica{'s' if replicas != 1 else ''} "
        f"(layers {[list(r) for r in layer_ranges]})"
    )


def describe_change(
    saved: SavedMesh, num_stages: int, num_replicas: int, layer_ranges: Sequence[Sequence[int]]
) -> str | None:
    """One line saying how a resume onto this mesh changes the saved one, or ``None`` when it does not."""
    if saved.same_as(num_stages, num_replicas, layer_ranges):
        return None
    old = _shape(saved.stages, saved.replicas, saved.layer_ranges)
    if saved.held != tuple(range(saved.replicas)):
        old += f", live replicas {list(saved.held)}"
    sources = replica_sources(saved.held, num_replicas)
    taken = {q for q, _ in sources}
    what = []
    for verb, continues in (("continues", True), ("copies", False)):
        pairs = [(r, q) for r, (q, c) in enumerate(sources) if c == continues and (q != r or not c)]
        if pairs:  # "replica 2 copies saved replica 0, 3 copies 1"
            (r, q), rest = pairs[0], pairs[1:]
            words = [f"replica {r} {verb} saved replica {q}", *(f"{r} {verb} {q}" for r, q in rest)]
            what.append(", ".join(words))
    dropped = [str(q) for q in saved.held if q not in taken]
    if dropped:
        what.append(f"saved replica{'s' if len(dropped) > 1 else ''} {', '.join(dropped)} dropped")
    if tuple(tuple(r) for r in layer_ranges) != saved.layer_ranges:
        what.append("each stage's tensors and optimizer state gathered by name")
    line = f"{old} -> {_shape(num_stages, num_replicas, layer_ranges)}"
    return line + (": " + "; ".join(what) if what else "")
