"""Export a NoLoCo run as one ordinary Hugging Face checkpoint: the consensus of the replicas, gathered.

The replicas of a stage never hold the same weights during NoLoCo training (there is no all-reduce), so the
exported model is a *consensus*: the mean of the replicas of each stage, or one chosen replica. Because a
:class:`~hf_noloco.engine.stage.PipelineStage` keeps the full model's parameter names, the union of the
stages' state dicts is the full model's state dict, and export is a merge on one rank followed by
``save_pretrained``.

Collectives, in order (every rank calls :func:`save_consensus_checkpoint`):

1. :func:`consensus_state_dict` — over ``mesh.replica_group``: all-reduce (mean) or broadcast (one replica).
2. :func:`gather_full_state_dict` — the ranks of replica column 0 send their stage to rank ``dst``, tensor by
   tensor (names, shapes and dtypes go first as one small JSON message).
3. Rank ``dst`` builds the model on the meta device, assigns the merged tensors, and saves safetensors.

The model card and the training-curve plot that go beside it are :mod:`hf_noloco.io.card`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hf_noloco.engine.buffers import consecutive_buckets, flatten, unflatten_into
from hf_noloco.engine.comm import peer_call
from hf_noloco.engine.loading import compute_missing_buffers
from hf_noloco.engine.structured import (
    PeerDataError,
    checked_dtype,
    checked_shape,
    dtype_name,
    recv_json,
    send_json,
)
from hf_noloco.rules import check_export_replica

logger = logging.getLogger(__name__)

# Mean-reduction happens in buckets of at most this many elements (in float32, 64 MiB): one collective per
# bucket instead of one per tensor, and never more than one bucket on the accelerator beside the training
# state.
_BUCKET_NUMEL = 16 * 1024 * 1024


# ----------------------------------------------------------------------------------------------------------
# Consensus and gather
# ----------------------------------------------------------------------------------------------------------


def _comm_device(mesh) -> torch.device:
    """NCCL only moves CUDA tensors; gloo moves CPU tensors."""
    if mesh.backend == "nccl":  # the mesh's (a joined column's default group is a stand-in)
        return mesh.device
    return torch.device("cpu")


@torch.no_grad()
def consensus_state_dict(stage: nn.Module, mesh, replica: int | None = None) -> dict[str, torch.Tensor]:
    """The consensus of this stage over its replicas. Collective over ``mesh.replica_group``: every rank calls
    it.

    Args:
        stage: this rank's stage module.
        mesh: the :class:`~hf_noloco.engine.mesh.PipelineMesh`.
        replica: ``None`` for the mean over replicas of every floating-point tensor (reduced in float32,
            returned in the tensor's own dtype); an index to take that replica's copy of every tensor.

    Returns:
        ``{name: CPU tensor}`` with this stage's state-dict names, in its order. Each bucket or tensor goes to
        the CPU as soon as it is reduced, so the accelerator holds one bucket beside the training state. The
        stage itself is not modified. A tied weight's second copy (the stage's ``mirrored_names``) is left
        out: the stage that holds the first one exports it.
    """
    check_export_replica(replica, mesh.num_replicas)
    if replica is not None and replica not in mesh.live_replicas:
        raise ValueError(
            f"export_replica={replica} was lost during the run; live replicas: {mesh.live_replicas}."
        )
    device = _comm_device(mesh)
    mirrored = getattr(stage, "mirrored_names", set())
    own = {name: t.detach() for name, t in stage.state_dict().items() if name not in mirrored}
    state = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in own.items()}  # filled below, on the CPU
    if mesh.num_live_replicas == 1:
        for name, tensor in own.items():
            state[name].copy_(tensor)
        return state
    group = mesh.replica_group

    def take_from(src: int, names) -> None:
        for name in names:
            buffer = own[name].to(device, copy=True).contiguous()
            with peer_call("the export's consensus and gather"):
                dist.broadcast(buffer, src=src, group=group)
            state[name].copy_(buffer)

    if replica is not None:
        take_from(mesh.rank_of(replica, mesh.stage), own)
        return state
    floating = [name for name, t in own.items() if t.is_floating_point()]
    for bucket in _buckets(floating, own):
        # One flat float32 buffer per bucket: fewer collectives, and bf16/fp16 weights are averaged without
        # rounding the partial sums.
        flat = flatten([own[name] for name in bucket], torch.float32).to(device)
        with peer_call("the export's consensus and gather"):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        unflatten_into([state[name] for name in bucket], flat.div_(mesh.num_live_replicas))
    # Integer buffers (counters, ids) have no mean: every replica takes the first live one's copy.
    take_from(
        mesh.rank_of(mesh.live_replicas[0], mesh.stage),
        [name for name, t in own.items() if not t.is_floating_point()],
    )
    return state


def _buckets(names: Sequence[str], state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    groups = consecutive_buckets([state[name].numel() for name in names], _BUCKET_NUMEL)
    return [[names[i] for i in group] for group in groups]


@torch.no_grad()
def gather_full_state_dict(
    stage_state_dict: Mapping[str, torch.Tensor] | None, mesh, dst: int | None = None
) -> dict[str, torch.Tensor] | None:
    """Merges the stages of the first live replica column (column 0 unless it was lost) into the full model's
    state dict on global rank ``dst``.

    Collective over the whole world: every rank calls it, but only the ranks of column 0
    (``mesh.rank_of(0, s)``) and ``dst`` take part; the others return ``None`` at once. Each sender first
    sends one small JSON message (the list of ``(name, shape, dtype)``), then each tensor as its own
    point-to-point message; the metadata is JSON (:mod:`hf_noloco.engine.structured`), never pickled.

    Args:
        stage_state_dict: this rank's stage tensors (e.g. from :func:`consensus_state_dict`); ignored outside
            column 0.
        mesh: the :class:`~hf_noloco.engine.mesh.PipelineMesh`.
        dst: global rank that receives; by default ``mesh.leader`` (rank 0 while no replica was lost).

    Returns:
        On ``dst``: ``{name: CPU tensor}`` for the whole model. Elsewhere: ``None``.
    """
    dst = mesh.leader if dst is None else dst
    if not 0 <= dst < mesh.world_size:
        raise ValueError(f"dst must be a global rank in [0, {mesh.world_size}), got {dst}.")
    senders = [mesh.rank_of(mesh.live_replicas[0], s) for s in range(mesh.num_stages)]
    group = mesh.world_group
    rank = mesh.rank
    device = _comm_device(mesh)
    if rank != dst:
        if rank not in senders:
            return None
        meta = [[name, list(t.shape), dtype_name(t.dtype)] for name, t in stage_state_dict.items()]
        send_json(meta, dst, group, device, what="the export's consensus and gather")
        for tensor in stage_state_dict.values():  # one tensor at a time on the communication device
            with peer_call("the export's consensus and gather"):
                dist.send(tensor.detach().to(device).contiguous(), dst=dst, group=group)
        return None

    merged: dict[str, torch.Tensor] = {}
    for src in senders:  # stage order, so the merged dict is in model order
        if src == dst:
            for name, tensor in stage_state_dict.items():
                merged[name] = tensor.detach().to("cpu", copy=True)
            continue
        meta = recv_json(src, group, device, what="the export's consensus and gather")
        for name, shape, dtype in _checked_meta(meta, src, merged):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            with peer_call("the export's consensus and gather"):
                dist.recv(tensor, src=src, group=group)
            merged[name] = tensor.cpu()
    return merged


def _checked_meta(meta, src: int, merged: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The ``[name, shape, dtype]`` list a stage sent, each entry checked (a string name not yet merged, a
    bounded shape, an allowed dtype) before any tensor is allocated for it."""
    what = f"the export's tensor list from rank {src}"
    if not isinstance(meta, list):
        raise PeerDataError(f"{what}: not a list")
    checked, names = [], set(merged)
    for entry in meta:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
            raise PeerDataError(f"{what}: a malformed entry")
        name, shape, dtype = entry
        if name in names or len(name) > 1024:
            raise PeerDataError(f"{what}: the tensor name {name[:100]!r} twice, or too long")
        names.add(name)
        checked.append((name, checked_shape(shape, what), checked_dtype(dtype, what)))
    return checked


def save_from_this_rank(model, output_dir: str) -> None:
    """``model.save_pretrained(output_dir)`` (safetensors) from whichever rank calls it. Under
    torch.distributed, transformers writes only on global rank 0 and silently skips the others; the rank that
    assembled the model writes it here, rank 0 or not (the first live replica's, once rank 0's was lost)."""
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(output_dir)


def _rebuild_computed_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary frequencies, Gemma's embedding scale) are computed, not carried by a
    state dict: after a meta-device build they are computed on the CPU, as
    :func:`~hf_noloco.engine.loading.build_stage` does."""
    base = getattr(model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is not None:
        with torch.device("cpu"):
            base.rotary_emb = type(rotary)(config=model.config)
    compute_missing_buffers(model, model)
    left = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(
            f"Export left tensors on the meta device (not in any stage's state dict): {left[:5]}"
        )


def build_model_from_state_dict(
    config, state_dict: Mapping[str, torch.Tensor], trust_remote_code: bool = False
):
    """A ``*ForCausalLM`` for ``config`` holding exactly ``state_dict``, never initialising random weights.
    A tied model's ``lm_head.weight`` may be missing: it is the embeddings. ``trust_remote_code``: the class
    is the checkpoint's own code (``config.auto_map``)."""
    from transformers import AutoModelForCausalLM

    from hf_noloco.engine.stage import TIED_COPY, TIED_SOURCE, ties_embeddings

    if ties_embeddings(config) and TIED_COPY not in state_dict and TIED_SOURCE in state_dict:
        state_dict = {**state_dict, TIED_COPY: state_dict[TIED_SOURCE]}
    dtypes = [t.dtype for t in state_dict.values() if t.is_floating_point()]
    dtype = dtypes[0] if dtypes else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    # strict: a missing or extra name means the stages did not cover the model, which must not be saved
    # silently.
    model.load_state_dict(dict(state_dict), strict=True, assign=True)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()  # assign=True replaced the shared parameter with two separate tensors
    _rebuild_computed_buffers(model)
    model.eval()
    return model


def save_consensus_checkpoint(
    stage: nn.Module,
    mesh,
    config,
    output_dir: str | os.PathLike,
    tokenizer=None,
    generation_config=None,
    replica: int | None = None,
    dst: int | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> str | None:
    """Exports the consensus model as one standard Hugging Face checkpoint. Every rank must call it.

    Writes ``config.json``, ``model.safetensors`` (safetensors only), ``generation_config.json`` and the
    tokenizer files to ``output_dir`` on rank ``dst``; the folder then loads with
    ``AutoModelForCausalLM.from_pretrained``.

    Args:
        stage: this rank's stage. mesh: the :class:`~hf_noloco.engine.mesh.PipelineMesh`.
        config: the full model's ``PretrainedConfig``.
        output_dir: destination folder (created if needed).
        tokenizer: saved next to the weights when given (anything with ``save_pretrained``).
        generation_config: a ``GenerationConfig`` to save (e.g. the base model's, with its list of end-of-text
            ids); default: the one derived from ``config``.
        replica: ``None`` for the replica mean, or the index of the replica to export as is.
        dst: global rank that assembles and writes the checkpoint (default: ``mesh.leader``).
        dtype: the dtype of the saved floating-point weights; default: the stages' own (the training dtype).
        trust_remote_code: the model class is the checkpoint's own code (saved beside the weights).

    Returns:
        The output folder on ``dst``, ``None`` elsewhere. There is no barrier at the end: callers that read
        the files from other ranks should wait (e.g. ``accelerator.wait_for_everyone()``).
    """
    consensus = consensus_state_dict(stage, mesh, replica=replica)
    dst = mesh.leader if dst is None else dst
    in_first_column = mesh.replica == mesh.live_replicas[0]
    full = gather_full_state_dict(consensus if in_first_column else None, mesh, dst=dst)
    del consensus
    if mesh.rank != dst:
        return None
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    model = build_model_from_state_dict(config, full, trust_remote_code)
    del full
    if generation_config is not None:
        model.generation_config = generation_config
    save_from_this_rank(model, output_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    what = "replica mean" if replica is None else f"replica {replica}"
    logger.info(
        "Saved the consensus model (%s of %d replicas) to %s", what, mesh.num_live_replicas, output_dir
    )
    return output_dir
