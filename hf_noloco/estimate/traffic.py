"""How many bytes a training step moves per rank, and how many of them cross node boundaries. Pure arithmetic:
no communication, no weights (a model config is read on the meta device).

Placement: ranks are ``replica * pipeline_stages + stage`` (see :mod:`hf_noloco.engine.mesh`) and node ``k``
holds ranks ``[k * procs_per_node, (k + 1) * procs_per_node)``, as torchrun and accelerate number them. Two
kinds of traffic are counted, as the bytes each rank *sends* (every byte crossing a link is sent by exactly
one rank, so a node's outgoing bytes are the sum over its ranks, and the total over ranks is what all links
carry):

- **pipeline**: each of the ``batch_size`` samples of a replica goes forward through every stage boundary
  as its activation (``seq_len x hidden_size`` in the activation dtype) plus the int64 record that travels
  with it (sample id, token count, labels, attention mask, positions: ``8 * (2 + 3 * seq_len)`` bytes), and
  its gradient comes back (``seq_len x hidden_size``). With ``sample``/``step`` routing the receiving
  replica is uniform over the sender's routing group (all replicas, or with ``routing_domain: node`` those
  of its node); random routing is counted by its expectation, or, given the samples a run really trained
  (``routing_keys``), by the router's own draws for them. ``fixed`` routing (or a group of one) keeps every
  sample in its replica column. A ``boundary_dtype`` (``boundary_grad_dtype``) counts the activations
  (gradients) as their packets, scales included (:func:`hf_noloco.engine.boundary_codec.bytes_per_token`).
- **sync**: ``ddp`` all-reduces the gradients every step, ``diloco`` the pseudo-gradients every
  ``inner_steps``, both counted as a ring all-reduce over the stage's replicas in replica order (each rank
  sends ``2 (n - 1) / n`` of the buffer to the next replica: what gloo does; NCCL picks its own rings and
  trees). ``noloco`` sends one copy of the stage (two when gamma != beta) to each gossip partner every
  ``inner_steps``; partners are uniform over the other replicas, so the expectation is counted too. A
  block-scaled ``outer_dtype`` (int8, float8_e4m3, int4) counts its packets, scales included
  (:func:`hf_noloco.outer.compression.wire_bytes`); diloco then all-gathers them (a ring all-gather: each
  rank sends ``n - 1`` packets on), which beats a float32 all-reduce below 8 replicas (int8) or 14 (int4).

Left out: TCP/IP headers (a few percent at a 1500-byte MTU), the per-step scalar all-reduce of the loss and
gradient norms over a replica column (under 100 bytes), evaluation, checkpoints and export.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_noloco.engine.boundary_codec import bytes_per_token
from hf_noloco.engine.routing import Router
from hf_noloco.engine.shape import mesh_shape
from hf_noloco.outer.compression import is_compressed, wire_bytes
from hf_noloco.outer.settings import OuterSettings
from hf_noloco.rules import (
    OUTER_STEP_METHODS,
    ROUTINGS,
    SCALED_BOUNDARY_DTYPES,
    check_boundary_formats,
    check_choice,
    check_positive_int,
)


def record_bytes_per_row(seq_len: int) -> int:
    """Bytes of the int64 record a sample carries between stages: id, token count, labels, mask, positions."""
    return 8 * (2 + 3 * seq_len)


def boundary_bytes_per_token(
    hidden: int, value_bytes: int, fmt: str | None = None, block_size: int | None = None
) -> int:
    """Bytes per token of one boundary tensor on the wire: ``hidden`` values of ``value_bytes`` each (the wire
    dtype), or ``fmt``'s packet (:func:`~hf_noloco.engine.boundary_codec.bytes_per_token`)."""
    if fmt is None:
        return hidden * value_bytes
    return bytes_per_token(fmt, hidden, block_size if fmt in SCALED_BOUNDARY_DTYPES else None)


def node_of(rank: int, procs_per_node: int) -> int:
    return rank // procs_per_node


@dataclass(frozen=True)
class RankTraffic:
    """What one rank sends. ``pipeline_*`` are bytes per step; ``sync_*`` bytes per synchronisation, which
    happens every ``sync_every`` steps (1 for ddp, ``inner_steps`` for diloco and noloco, never for local)."""

    rank: int
    node: int
    stage: int
    replica: int
    pipeline_cross: float
    pipeline_intra: float
    sync_cross: float
    sync_intra: float
    sync_every: int | None

    @property
    def cross_per_step(self) -> float:
        """Bytes per step sent to other nodes (syncs spread over their interval)."""
        return self.pipeline_cross + (self.sync_cross / self.sync_every if self.sync_every else 0.0)

    @property
    def intra_per_step(self) -> float:
        """Bytes per step sent to ranks of the same node."""
        return self.pipeline_intra + (self.sync_intra / self.sync_every if self.sync_every else 0.0)


@dataclass(frozen=True)
class Traffic:
    """Every rank's :class:`RankTraffic` for one configuration."""

    ranks: tuple[RankTraffic, ...]
    procs_per_node: int

    @property
    def num_nodes(self) -> int:
        return max(r.node for r in self.ranks) + 1

    def mean(self, attribute: str) -> float:
        """The mean over ranks of a :class:`RankTraffic` attribute (``"cross_per_step"``...)."""
        return sum(getattr(r, attribute) for r in self.ranks) / len(self.ranks)

    @property
    def cross_per_rank(self) -> float:
        """Bytes per step and rank that cross node boundaries (mean over ranks)."""
        return self.mean("cross_per_step")

    @property
    def intra_per_rank(self) -> float:
        """Bytes per step and rank that stay inside nodes (mean over ranks)."""
        return self.mean("intra_per_step")

    def node_egress_per_step(self, node: int) -> float:
        """Bytes per step that leave ``node``: what its uplink must carry."""
        return sum(r.cross_per_step for r in self.ranks if r.node == node)

    def cross_bytes(self, steps: int, syncs: int | None = None) -> float:
        """Bytes sent across node boundaries by all ranks together over ``steps`` steps holding ``syncs``
        synchronisations (default: ``steps / sync_every``, i.e. the per-step average)."""
        total = 0.0
        for r in self.ranks:
            total += steps * r.pipeline_cross
            if r.sync_every:
                total += (steps / r.sync_every if syncs is None else syncs) * r.sync_cross
        return total


def stage_parameter_counts(
    config, pipeline_stages: int, stage_boundaries: Sequence[int] | None = None, stage_balance: str = "layers"
) -> list[int]:
    """Parameters of each stage, split exactly as training splits the model (on the meta device: no
    memory)."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    from hf_noloco.engine.partition import split_model

    if not isinstance(config, PretrainedConfig):
        from transformers import AutoConfig

        values = dict(config)
        config = AutoConfig.for_model(values.pop("model_type", "llama"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = []
    for stage in range(pipeline_stages):
        module = split_model(model, stage, pipeline_stages, stage_boundaries, stage_balance)
        counts.append(sum(p.numel() for p in module.parameters()))
    return counts


def _hidden_size(config) -> int:
    value = config["hidden_size"] if isinstance(config, dict) else config.get_text_config().hidden_size
    check_positive_int("hidden_size", value)
    return value


def _ring_sends(
    stage_ranks: list[int], nbytes: float, procs_per_node: int, gather: bool = False
) -> list[tuple[float, float]]:
    """(cross, intra) bytes each member of a ring all-reduce (or, ``gather``, a ring all-gather of
    ``nbytes`` from each member) sends to its successor."""
    n = len(stage_ranks)
    if n == 1:
        return [(0.0, 0.0)]
    per_rank = (n - 1) * nbytes if gather else 2 * (n - 1) / n * nbytes
    out = []
    for i, rank in enumerate(stage_ranks):
        successor = stage_ranks[(i + 1) % n]
        cross = node_of(rank, procs_per_node) != node_of(successor, procs_per_node)
        out.append((per_rank, 0.0) if cross else (0.0, per_rank))
    return out


def _gossip_partners(num_replicas: int, group_size: int) -> float:
    """Expected partners of a replica: the gossip groups are a fixed multiset of sizes (see
    :func:`hf_noloco.outer.gossip.gossip_groups`) and a replica lands in each position with equal
    probability."""
    num_groups = num_replicas // group_size
    sizes = [group_size + (1 if g < num_replicas % group_size else 0) for g in range(num_groups)]
    return sum(s * (s - 1) for s in sizes) / num_replicas


def step_traffic(
    config,
    *,
    seq_len: int,
    batch_size: int,
    pipeline_stages: int,
    num_replicas: int,
    procs_per_node: int,
    routing: str = "sample",
    routing_group_size: int | None = None,
    outer: OuterSettings | None = None,
    activation_bytes: int = 4,
    grad_bytes: int = 4,
    stage_params: Sequence[int] | None = None,
    stage_boundaries: Sequence[int] | None = None,
    stage_balance: str = "layers",
    routing_seed: int = 0,
    routing_keys: Sequence[tuple[int, int]] | None = None,
    boundary_dtype: str | None = None,
    boundary_grad_dtype: str | None = None,
    boundary_block_size: int | None = None,
) -> Traffic:
    """The bytes every rank sends per step, split into those that cross node boundaries and those that stay.

    Args:
        config: the model's config (a ``PretrainedConfig`` or a dict with ``model_type``); only
            ``hidden_size`` and the stage sizes are used.
        seq_len / batch_size: tokens per sample and samples per replica per step.
        pipeline_stages / num_replicas: the mesh (pp, dp); ``procs_per_node`` processes run on each node.
        routing: ``"sample"``, ``"step"`` or ``"fixed"``; ``routing_group_size`` replicas per routing group
            (``None``: all, i.e. ``routing_domain: global``).
        outer: the outer method and its settings (``None``: noloco with the paper's defaults).
        activation_bytes: bytes per activation value on the wire (the engine sends the parameters' dtype: 4
            for float32 weights, 2 for bfloat16 ones). ``grad_bytes``: per gradient value (ddp).
        stage_params: parameters of each stage; ``None`` splits ``config`` as training would
            (``stage_boundaries``, ``stage_balance``).
        routing_keys: ``(step, per-replica sample index)`` of the samples a run trained (``batch_size`` per
            step), e.g. a measured window: the pipeline bytes are then counted with the router's real
            permutations for them (``routing_seed``) instead of their expectation.
        boundary_dtype / boundary_grad_dtype / boundary_block_size: the options of that name (``None``:
            ``activation_bytes`` per value).
    """
    check_choice("routing", routing, ROUTINGS)
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("procs_per_node", procs_per_node)):
        check_positive_int(name, value)
    num_replicas, pp = mesh_shape(num_replicas * pipeline_stages, pipeline_stages)
    world = num_replicas * pp
    outer = outer if outer is not None else OuterSettings()
    group = num_replicas if routing_group_size is None else routing_group_size
    if group < 1 or num_replicas % group:
        raise ValueError(f"routing_group_size={group} does not divide the {num_replicas} replicas.")
    if routing == "fixed":
        group = 1
    if stage_params is None:
        stage_params = stage_parameter_counts(config, pp, stage_boundaries, stage_balance)
    if len(stage_params) != pp:
        raise ValueError(f"stage_params lists {len(stage_params)} stages, pipeline_stages={pp}.")
    hidden = _hidden_size(config)
    check_boundary_formats(boundary_dtype, boundary_grad_dtype, boundary_block_size, False)
    forward_bytes = seq_len * boundary_bytes_per_token(
        hidden, activation_bytes, boundary_dtype, boundary_block_size
    ) + record_bytes_per_row(seq_len)
    backward_bytes = seq_len * boundary_bytes_per_token(
        hidden, activation_bytes, boundary_grad_dtype, boundary_block_size
    )

    def node(replica: int, stage: int) -> int:
        return node_of(replica * pp + stage, procs_per_node)

    router = Router(num_replicas, routing, routing_seed, group_size=group) if routing_keys else None

    def routed(replica: int, stage: int, other_stage: int, nbytes: float) -> tuple[float, float]:
        """(cross, intra) bytes per step of ``batch_size`` samples sent from ``(replica, stage)`` to the
        replicas of ``other_stage`` its routing group may pick, each with probability 1 / group (or, with
        ``routing_keys``, the replicas the router really picked)."""
        if router is None:
            start = replica - replica % group
            peers = list(range(start, start + group))
        elif other_stage > stage:  # forward: replica r of stage b sends to perm[r] of stage b + 1
            peers = [router.permutation(stage, step, k)[replica] for step, k in routing_keys]
        else:  # backward: the gradient goes back to the replica that sent the sample
            peers = [router.permutation(other_stage, step, k).index(replica) for step, k in routing_keys]
        crossing = sum(node(q, other_stage) != node(replica, stage) for q in peers) / len(peers)
        total = batch_size * nbytes
        return total * crossing, total * (1 - crossing)

    sync = {}  # (replica, stage) -> (cross, intra) per synchronisation
    sync_every = {"ddp": 1, "local": None}.get(outer.outer_optimizer, outer.inner_steps)
    for stage in range(pp):
        ranks = [r * pp + stage for r in range(num_replicas)]
        if outer.outer_optimizer in ("ddp", "diloco"):
            nbytes = stage_params[stage] * grad_bytes
            gather = outer.outer_optimizer == "diloco" and is_compressed(outer.outer_dtype)
            if outer.outer_optimizer == "diloco":
                nbytes = wire_bytes(stage_params[stage], outer.outer_dtype)
            for replica, sends in enumerate(_ring_sends(ranks, nbytes, procs_per_node, gather)):
                sync[replica, stage] = sends
        elif outer.outer_optimizer == "noloco" and num_replicas > 1:
            # theta, or two quantities when gamma != beta (theta and phi; compressed: Delta and phi)
            copy = wire_bytes(stage_params[stage], outer.outer_dtype) * (2 if outer.sends_slow_weights else 1)
            partners = _gossip_partners(num_replicas, outer.gossip_group_size)
            for replica in range(num_replicas):
                others = [j for j in range(num_replicas) if j != replica]
                crossing = sum(node(j, stage) != node(replica, stage) for j in others) / len(others)
                total = partners * copy
                sync[replica, stage] = (total * crossing, total * (1 - crossing))
    assert outer.outer_optimizer in OUTER_STEP_METHODS or outer.outer_optimizer in ("ddp", "local")

    ranks = []
    for rank in range(world):
        replica, stage = divmod(rank, pp)
        cross = intra = 0.0
        if stage < pp - 1:  # activations (and records) to the next stage
            c, i = routed(replica, stage, stage + 1, forward_bytes)
            cross, intra = cross + c, intra + i
        if stage > 0:  # gradients back to the previous stage, along the same paths
            c, i = routed(replica, stage, stage - 1, backward_bytes)
            cross, intra = cross + c, intra + i
        sync_cross, sync_intra = sync.get((replica, stage), (0.0, 0.0))
        ranks.append(
            RankTraffic(
                rank,
                node_of(rank, procs_per_node),
                stage,
                replica,
                cross,
                intra,
                sync_cross,
                sync_intra,
                sync_every,
            )
        )
    return Traffic(tuple(ranks), procs_per_node)


# ----------------------------------------------------------------------------------------------------------
# The table (python -m hf_noloco.traffic)
# ----------------------------------------------------------------------------------------------------------

LLAMA_3_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)

# (label, method, routing, routing domain, outer dtype)
TABLE_ROWS = [
    ("ddp, `sample` routing", "ddp", "sample", "global", "float32"),
    ("diloco (H=100), `sample` routing", "diloco", "sample", "global", "float32"),
    ("noloco (H=50), `sample` routing, global", "noloco", "sample", "global", "float32"),
    ("noloco (H=50), `sample` routing, node", "noloco", "sample", "node", "float32"),
    ("noloco (H=50), `fixed` routing", "noloco", "fixed", "global", "float32"),
    ("noloco (H=50), node routing, `outer_dtype: bfloat16`", "noloco", "sample", "node", "bfloat16"),
]


def traffic_table(
    config, seq_len: int, batch_size: int, pipeline_stages: int, num_replicas: int, procs_per_node: int,
    activation_bytes: int = 4,
) -> str:  # fmt: skip
    """A markdown table of :func:`step_traffic` for the usual configurations of one placement (MiB per step
    and rank, means over ranks; the last column what leaves the busiest node)."""
    stage_params = stage_parameter_counts(config, pipeline_stages)
    lines = [
        "| configuration | pipeline, crossing | pipeline, inside | sync, crossing | sync, inside "
        "| leaves a node (GiB/step) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, method, routing, domain, dtype in TABLE_ROWS:
        group = None
        if domain == "node":
            group = max(min(procs_per_node // pipeline_stages, num_replicas), 1)
        t = step_traffic(
            config,
            seq_len=seq_len,
            batch_size=batch_size,
            pipeline_stages=pipeline_stages,
            num_replicas=num_replicas,
            procs_per_node=procs_per_node,
            routing=routing,
            routing_group_size=group,
            outer=OuterSettings(method, outer_dtype=dtype) if method != "ddp" else OuterSettings("ddp"),
            activation_bytes=activation_bytes,
            stage_params=stage_params,
        )
        sync_cross = t.mean("cross_per_step") - t.mean("pipeline_cross")
        sync_intra = t.mean("intra_per_step") - t.mean("pipeline_intra")
        busiest = max(t.node_egress_per_step(n) for n in range(t.num_nodes))
        mib = lambda x: f"{x / 2**20:,.0f}"
        pipeline = f"{mib(t.mean('pipeline_cross'))} | {mib(t.mean('pipeline_intra'))}"
        lines.append(
            f"| {label} | {pipeline} | {mib(sync_cross)} | {mib(sync_intra)} | {busiest / 2**30:,.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m hf_noloco.traffic",
        description="Bytes per step and rank that cross node boundaries, and that stay inside nodes, for the "
        "usual methods and routings of one placement (a markdown table).",
    )
    parser.add_argument("--model", default="llama-3-8b", help="a config.json path, a Hub id, or llama-3-8b")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--batch_size", type=int, default=8, help="samples per replica and step")
    parser.add_argument("--pipeline_stages", type=int, default=4)
    parser.add_argument("--num_replicas", type=int, default=8)
    parser.add_argument("--procs_per_node", type=int, default=8)
    parser.add_argument("--activation_bytes", type=int, default=4, help="4: float32 weights, 2: bfloat16")
    args = parser.parse_args(argv)
    if args.model == "llama-3-8b":
        config = LLAMA_3_8B
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
    placement = (args.pipeline_stages, args.num_replicas, args.procs_per_node)
    print(traffic_table(config, args.seq_len, args.batch_size, *placement, args.activation_bytes))


if __name__ == "__main__":
    main()
