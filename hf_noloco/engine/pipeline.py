"""The pipeline engine: one optimizer step of one stage replica, microbatch by microbatch.

Every rank of a replica column holds the same batch (the data is sharded by replica). A microbatch of
``M`` rows is computed as one tensor; at each stage boundary its rows are grouped by the replica of the
next stage that the router assigns them to and sent as one message per destination. Rows keep their
position inside the microbatch on every stage, so a receiver reassembles them by index.

Each row travels with an int64 record: its sample id, the target-token count of the batch it came from,
its labels, attention mask and position ids. The last stage weights each sample's summed cross-entropy by
``1 / tokens of its origin batch``, so the loss of a replica is a sum of per-shard mean losses and the
mean of the replicas' gradients equals data parallel's gradient whatever the routing. Gradients go back
along the same paths.

The order of computes and messages is the plan of :mod:`hf_noloco.engine.schedule` (1F1B by default, GPipe,
or ZB-H1), which batches every send with the receive the peer needs at the same moment, so that it cannot
deadlock under NCCL; the engine runs that plan and nothing else. Under ZB-H1 a stage's backward is split
(:mod:`hf_noloco.engine.split_backward`): B computes the input gradient, which leaves at once, and W the
weight gradients, later, where the plan puts it.

The host never waits per microbatch on a GPU: a batch's receives are waited for where their data is first
used (a stream wait on NCCL, so the compute queued before that point runs while they travel; under ZB-H1 a
W), its sends at the end of the step (their buffers are never reused within it); stage 0 copies its batch to
the device once per step, from pinned memory and without waiting; the rows of a routed message are indexed by
tensors made from pinned memory, kept in a bounded cache; and packed rows under flash-attention get their
sequence boundaries (``cu_seq_lens``, ``max_length``) once per microbatch, computed on the host where the
positions are host data (stage 0), not from the positions in every decoder layer.

No forward is recomputed unless asked: activation checkpointing of the decoder layers
(``PipelineStage.activation_checkpointing_enable``) and the chunked loss (``loss_chunk_tokens``) trade a
recomputation for memory. Activations and gradients travel in
``wire_dtype`` (bfloat16 under bf16 mixed precision: half the bytes) and are computed in the stage's dtype,
unless ``boundary_dtype`` / ``boundary_grad_dtype`` name a format of :mod:`hf_noloco.engine.boundary_codec`:
then a microbatch's tensor is encoded once, before it is sent (tensor operations only: no host sync), each
receiver gets the packet rows of its samples, and decodes them where they are first used.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

from hf_noloco.engine.boundary_codec import decode, encode, packet_layout
from hf_noloco.engine.capacity import boundary_pairs, wave_counts
from hf_noloco.engine.comm import abandon, collective, exchange, post, strict_p2p, wait_sends
from hf_noloco.engine.losses import TOKEN_STATS, next_token_losses, target_token_count
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.routing import Router
from hf_noloco.engine.schedule import BACKWARD, FORWARD, Post, capacity_links, routed_links, step_plan
from hf_noloco.engine.split_backward import backward_input
from hf_noloco.engine.stage import PipelineStage, offload_saved_tensors, packed_sequence_lengths
from hf_noloco.rules import (
    LOSS_TYPES,
    PIPELINE_SCHEDULES,
    SCALED_BOUNDARY_DTYPES,
    check_boundary_formats,
    check_choice,
    check_microbatch_size,
    check_positive_int,
)

_META_FIXED = 2  # sample id, origin batch's target-token count; then labels, attention mask, positions
_INDEX_CACHE = 256  # row indices kept on the device (sample routing draws other rows every microbatch)


@dataclass
class StepResult:
    """What one stage replica knows after a step. ``loss`` is set on the last stage only: the sum over the
    samples it processed of (summed token cross-entropy / target tokens of the sample's origin batch)."""

    loss: torch.Tensor | None
    target_tokens: torch.Tensor | None = None  # target tokens the last stage scored
    token_stats: torch.Tensor | None = (
        None  # last stage: right predictions, summed entropy (losses.TOKEN_STATS)
    )
    sample_id_tensors: list[torch.Tensor] = field(default_factory=list)  # per microbatch, as processed here

    @property
    def sample_ids(self) -> list[list[int]]:
        # Converted only on request: on a GPU, .tolist() would wait for the device.
        return [ids.tolist() for ids in self.sample_id_tensors]


class PipelineEngine:
    """Runs training and evaluation steps of one stage replica.

    Args:
        stage: this rank's :class:`PipelineStage`.
        mesh: the process mesh.
        router: draws the replica pairing at each boundary (``Router(mesh.num_replicas, ...)``).
        microbatch_size: rows per microbatch; the per-replica batch must be a multiple of it.
        p2p_timeout: seconds to wait for a peer before failing with an error that names it.
        autocast: a context manager factory wrapping each stage forward (e.g. bf16 autocast), or None.
        schedule: ``"1f1b"`` (bounded activation memory), ``"gpipe"`` or ``"zb-h1"`` (1F1B's order with the
            weight gradients moved into the bubble; the first stage's peak of activations is 1F1B's); see
            :func:`~hf_noloco.engine.schedule.pipeline_order`. Under activation checkpointing ``"zb-h1"``
            runs each whole backward at B time (1F1B's computation in 1F1B's order; see
            :mod:`~hf_noloco.engine.split_backward` for why).
        wire_dtype: the dtype activations and gradients travel in (default: the stage's own).
        loss_chunk_tokens: the last stage scores this many positions at a time, recomputing each chunk's
            logits in the backward pass, so it never holds a microbatch's full logits; ``None``: all at once
            (see :func:`~hf_noloco.engine.losses.next_token_losses`).
        loss_type: ``"nll"`` or ``"dft"`` (each token's loss weighted by its predicted probability).
        offload_activations: what a training forward saves for its backward is kept in host memory (pinned,
            copied without blocking: :func:`~hf_noloco.engine.stage.offload_saved_tensors`).
        boundary_dtype / boundary_grad_dtype: the format of :mod:`~hf_noloco.engine.boundary_codec` the
            activations / their gradients travel in; ``None``: ``wire_dtype``.
        boundary_block_size: values per scale of the scaled formats (``None``: one scale per token).
        boundary_grad_stochastic_rounding: the scaled gradient format rounds stochastically, seeded from the
            router's seed, the step, the microbatch, this stage and replica.
    """

    def __init__(
        self,
        stage: PipelineStage,
        mesh: PipelineMesh,
        router: Router,
        microbatch_size: int,
        p2p_timeout: float = 300.0,
        autocast=None,
        schedule: str = "1f1b",
        loss_chunk_tokens: int | None = None,
        wire_dtype: torch.dtype | None = None,
        loss_type: str = "nll",
        offload_activations: bool = False,
        boundary_dtype: str | None = None,
        boundary_grad_dtype: str | None = None,
        boundary_block_size: int | None = None,
        boundary_grad_stochastic_rounding: bool = False,
    ):
        check_choice("pipeline_schedule", schedule, PIPELINE_SCHEDULES)
        check_choice("loss_type", loss_type, LOSS_TYPES)
        check_microbatch_size(microbatch_size, microbatch_size)
        if router.num_replicas != mesh.num_replicas:
            raise ValueError(f"router has {router.num_replicas} replicas, the mesh {mesh.num_replicas}.")
        self.stage = stage
        self.mesh = mesh
        self.router = router
        self.microbatch_size = microbatch_size
        self.p2p_timeout = p2p_timeout
        self.autocast = autocast or contextlib.nullcontext
        self.schedule = schedule
        if loss_chunk_tokens is not None:
            check_positive_int("loss_chunk_tokens", loss_chunk_tokens)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.loss_type, self.offload_activations = loss_type, offload_activations
        self.peak_microbatches_held = 0  # of the last step (forward done, weight gradients not): activations
        # Host seconds the last step spent waiting for peers (posting and waiting for messages): its bubble
        # as this rank saw it, on gloo (under NCCL's stream waits the host does not wait).
        self.wait_seconds = 0.0
        # Host seconds of the last step not spent waiting for peers, and the rows this rank computed in it:
        # its speed, for capacity routing (on a GPU the host runs ahead of the device; read it as a bound).
        self.compute_seconds, self.rows_computed = 0.0, 0
        self.device = next(stage.parameters()).device
        self.activation_dtype = next(stage.parameters()).dtype
        self.wire_dtype = wire_dtype or self.activation_dtype
        check_boundary_formats(
            boundary_dtype, boundary_grad_dtype, boundary_block_size, boundary_grad_stochastic_rounding
        )
        self.boundary_formats = {FORWARD: boundary_dtype, BACKWARD: boundary_grad_dtype}
        self.boundary_block_size = boundary_block_size
        self.boundary_grad_stochastic_rounding = boundary_grad_stochastic_rounding
        self._layouts = {}  # phase -> the packet's (dtype, elements per token), None for wire_dtype
        for phase, fmt in self.boundary_formats.items():  # a block size the model refuses fails here
            block = boundary_block_size if fmt in SCALED_BOUNDARY_DTYPES else None
            self._layouts[phase] = (
                None if fmt is None else packet_layout(fmt, stage.config.hidden_size, block)
            )
        self._rounding = torch.Generator(device=self.device) if boundary_grad_stochastic_rounding else None
        self._indices: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # see _index
        self.step_index = 0  # training steps run: the routing key of `step` granularity
        self.samples_seen = 0  # per-replica samples trained on: the routing key of `sample` granularity
        # Capacity routing: every stage's replicas' speeds, and the least share of a wave's rows any replica
        # gets (None: every replica computes microbatch_size rows, today's routing).
        self.capacity: tuple[list[list[float]], float] | None = None
        self._rows_of: Callable[[int], int] = lambda m: self.microbatch_size

    # ----------------------------------------------------------------------------------------- public

    def route_over(self, live_replicas: list[int]) -> None:
        """From the next step on, samples are routed among ``live_replicas`` only (the live replicas changed:
        ``on_replica_loss="continue"``)."""
        self.router = Router(
            self.mesh.num_replicas, self.router.granularity, self.router.seed, live=live_replicas
        )

    def route_by_capacity(self, speeds: list[list[float]] | None, floor: float = 0.0) -> None:
        """From the next training step on, each replica of stage ``s`` computes a share of every microbatch's
        ``num_replicas * microbatch_size`` rows in proportion to ``speeds[s][replica]`` (no share below
        ``floor``, nor below one row): same microbatches, same order, fewer rows on a slower replica
        (:func:`~hf_noloco.engine.capacity.wave_counts`, :func:`~hf_noloco.engine.schedule.capacity_links`).
        Every rank must be given the same speeds. ``None``: equal rows again. Equal speeds route exactly as
        without."""
        if speeds is not None:
            mesh = self.mesh
            if len(speeds) != mesh.num_stages or any(len(row) != mesh.num_replicas for row in speeds):
                raise ValueError(f"speeds must be {mesh.num_stages} stages x {mesh.num_replicas} replicas.")
            if self.router.granularity == "fixed":
                raise ValueError("Capacity routing needs random routing (routing='sample' or 'step').")
            if len(self.router.live) != self.router.num_replicas:
                raise ValueError("Capacity routing does not yet route among the live replicas only.")
        self.capacity = None if speeds is None else ([list(map(float, r)) for r in speeds], float(floor))

    def capacity_rows(self, num_micro: int) -> list[list[list[int]]] | None:
        """``rows[stage][m][replica]`` of the next training step's ``num_micro`` microbatches (None:
        equal rows)."""
        if self.capacity is None:
            return None
        speeds, floor = self.capacity[0], self.capacity_floor()
        group, micro = self.router.group_size, self.microbatch_size
        keys = (self.router.seed, self.step_index)
        return [
            [wave_counts(stage_speeds, micro, group, *keys, s, m, floor=floor) for m in range(num_micro)]
            for s, stage_speeds in enumerate(speeds)
        ]

    def capacity_floor(self) -> Fraction:
        """The least share of a routing group's rows a replica gets: the given floor, and at least one row
        per microbatch."""
        given = Fraction(repr(self.capacity[1])) if self.capacity is not None else Fraction(0)
        return max(given, Fraction(1, self.router.group_size * self.microbatch_size))

    def train_step(self, batch: dict[str, torch.Tensor]) -> StepResult:
        """Forward and backward of every microbatch of ``batch`` (gradients accumulate in ``.grad``)."""
        result = self._run(batch, self.router, self.microbatch_size, training=True)
        self.step_index += 1
        self.samples_seen += batch["input_ids"].shape[0]
        return result

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor], router: Router | None = None) -> tuple[float, int]:
        """``(summed token cross-entropy, target tokens)`` of ``batch``, evaluated by this replica column
        (``fixed`` routing unless a router is given), returned on every rank of the column. A last, smaller
        batch is fine: its microbatches shrink to a divisor of its rows."""
        totals = self.eval_totals(batch, router)
        return totals[0].item(), int(totals[1].item())

    @torch.no_grad()
    def eval_totals(
        self,
        batch: dict[str, torch.Tensor],
        router: Router | None = None,
        on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """:meth:`eval_step`'s sums, and the right predictions and summed entropy of the target positions,
        as one float64 tensor on the device (no host sync), the same on every rank of the column.

        ``on_logits(logits, labels)``: called by the last stage with each microbatch's logits (rows, tokens,
        vocabulary) and its labels (not shifted), in the batch's row order; the loss is computed from the
        same logits (never chunked then)."""
        router = router or Router(self.mesh.num_replicas, "fixed")
        rows = batch["input_ids"].shape[0]
        micro = math.gcd(rows, self.microbatch_size)
        result = self._run(batch, router, micro, training=False, on_logits=on_logits)
        totals = torch.zeros(2 + TOKEN_STATS, dtype=torch.float64, device=self.device)
        if self.stage.is_last:
            totals[0], totals[1] = result.loss.double(), result.target_tokens
            totals[2:] = result.token_stats
        if self.mesh.num_stages > 1:
            last = self.mesh.rank_of(self.mesh.replica, self.mesh.num_stages - 1)
            what = self._context("the evaluation loss broadcast", None)
            collective(
                dist.broadcast,
                totals,
                last,
                group=self.mesh.column_group,
                timeout=self.p2p_timeout,
                what=what,
            )
        return totals

    def state_dict(self) -> dict[str, int]:
        return {"step_index": self.step_index, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_index = int(state["step_index"])
        self.samples_seen = int(state["samples_seen"])

    # ---------------------------------------------------------------------------------------- schedule

    def _run(
        self,
        batch: dict[str, torch.Tensor],
        router: Router,
        micro: int,
        training: bool,
        on_logits: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> StepResult:
        rows, seq_len = self._check_batch(batch, micro)
        mesh, stage = self.mesh, self.stage
        # Every rank of a column reads the same kind of batch. Padded rows: the mask goes to the stages.
        # Packed sequences (position ids restarting at each): the positions go, and HF's mask code keeps
        # attention inside each sequence (their mask only marks the padding, for counting). Wrapped rows:
        # neither, and HF's mask code has nothing to look for (which would wait for the device).
        has_positions = batch.get("position_ids") is not None
        has_mask = batch.get("attention_mask") is not None and not has_positions
        input_ids = meta = varlen = None
        if stage.is_first:  # the batch to the device once, without waiting (other stages use none of it)
            input_ids = self._on_device(batch["input_ids"])
            meta = self._make_meta(batch, rows, seq_len)
            if has_positions and stage.flattens_packed_rows and stage.uses_flash_attention:
                varlen = self._packed_lengths(batch["position_ids"], micro)
        inputs, outputs, sample_ids = {}, {}, []
        outgoing, arrived, pending = {}, {}, []  # (phase, m) -> tensors to send / received; sends in flight
        # (phase, m) -> receives posted, not yet waited for: (works, parts, context, the batch's sends)
        self._awaited = {}
        weights = {}  # m -> the deferred W of microbatch m (zb-h1), absent where B ran the whole backward
        # Stage 0 has no input gradient to send: its B is the whole backward, as it is under checkpointing.
        split = self.schedule == "zb-h1" and not stage.is_first and not stage.is_activation_checkpointing
        loss = torch.zeros((), dtype=torch.float32, device=self.device) if stage.is_last else None
        target_tokens = torch.zeros((), dtype=torch.int64, device=self.device)
        token_stats = (
            torch.zeros(TOKEN_STATS, dtype=torch.float64, device=self.device) if stage.is_last else None
        )
        offload = offload_saved_tensors if training and self.offload_activations else contextlib.nullcontext

        def forward(m: int) -> None:
            nonlocal loss
            if stage.is_first and isinstance(input_ids, list):  # capacity routing: this replica's rows
                x, mb_meta = input_ids[m], meta[m]
            elif stage.is_first:
                x, mb_meta = input_ids[m * micro : (m + 1) * micro], meta[m * micro : (m + 1) * micro]
            else:
                x, mb_meta = self._decode(self._arrived(arrived, FORWARD, m, micro), FORWARD, seq_len)
                x = x.to(self.activation_dtype).requires_grad_(training)
            sample_ids.append(mb_meta[:, 0])
            labels, attention_mask, position_ids = _unpack_meta(mb_meta, seq_len, has_mask, has_positions)
            lengths = varlen[m] if varlen is not None else None
            with self.autocast(), offload():
                y = stage(
                    x, attention_mask=attention_mask, position_ids=position_ids, logits=False, varlen=lengths
                )
                if stage.is_last and on_logits is not None:  # the logits whole, for the caller too
                    logits = stage.extras.logits(stage.lm_head(y))
                    token_losses = next_token_losses(
                        logits, labels, stats=token_stats, loss_type=self.loss_type
                    )
                    on_logits(logits.reshape(*labels.shape, -1), labels)  # (packed rows may come flat)
                elif stage.is_last:  # y: the final hidden states; lm_head is applied inside the loss
                    token_losses = next_token_losses(
                        y,
                        labels,
                        stage.lm_head,
                        self.loss_chunk_tokens,
                        stage.extras,
                        token_stats,
                        self.loss_type,
                    )
            if stage.is_last:
                target_tokens.add_(target_token_count(labels))
                if training:  # a sample's weight is 1 / (target tokens of the batch it came from)
                    y = (token_losses.sum(1) / mb_meta[:, 1].clamp(min=1)).sum()
                    loss += y.detach()
                else:
                    loss += token_losses.sum()
            else:
                outgoing[FORWARD, m] = (*self._encode(y.detach(), FORWARD, m), mb_meta)
            if training:
                inputs[m], outputs[m] = x, y
            held = len(outputs) + len(weights)
            self.peak_microbatches_held = max(self.peak_microbatches_held, held)

        def backward(m: int) -> None:
            x, y = inputs.pop(m), outputs.pop(m)  # dropping them frees the microbatch's activations
            if not stage.is_last:
                received = self._arrived(arrived, BACKWARD, m, micro)
                grad = self._decode(received, BACKWARD, seq_len, y.dtype)[0].to(y.dtype)
            else:
                grad = None
            if split:  # the weight gradients' share of the graph stays alive in weights[m] until its W
                x_grad, weights[m] = backward_input(y, grad, x, stage.parameters())
            else:
                torch.autograd.backward(y, grad)
                x_grad = x.grad
            if not stage.is_first:
                outgoing[BACKWARD, m] = self._encode(x_grad, BACKWARD, m)

        def weight(m: int) -> None:
            deferred = weights.pop(m, None)
            if deferred is not None:
                deferred()

        self.peak_microbatches_held, self.wait_seconds = 0, 0.0
        began = time.perf_counter()
        capacity = self.capacity_rows(rows // micro) if training else None
        if capacity is not None and all(c == micro for s in capacity for w in s for c in w):
            capacity = None  # equal rows: today's routing, bit for bit
        if capacity is None:
            self._rows_of = lambda m: micro
            links = routed_links(
                router, mesh.num_stages, mesh.stage, mesh.replica, self.step_index, self.samples_seen, micro
            )
        else:
            own = [wave[mesh.replica] for wave in capacity[mesh.stage]]
            self._rows_of = own.__getitem__
            links = capacity_links(
                router, capacity, mesh.num_stages, mesh.stage, mesh.replica, self.step_index,
                self.samples_seen, micro,
            )  # fmt: skip
            if varlen is not None:
                raise ValueError(
                    "Capacity routing does not yet carry packed rows' flash-attention boundaries: use "
                    "attn_implementation='sdpa' or 'eager' with packed rows, or equal routing."
                )
            if stage.is_first:  # each replica's share of every wave's input rows, from their shards
                input_ids, meta = self._redistribute(input_ids, meta, capacity[0], micro)
        schedule = self.schedule if training else "forward"
        plan = step_plan(schedule, rows // micro, mesh.num_stages, mesh.stage, mesh.rank, links)
        try:
            for item in plan:
                if isinstance(item, Post):
                    pending += self._post(item, outgoing, arrived, micro, seq_len)
                elif item.phase == FORWARD:
                    forward(item.microbatch)
                elif item.phase == BACKWARD:
                    backward(item.microbatch)
                else:
                    weight(item.microbatch)
            start = time.perf_counter()
            wait_sends(
                [work for work, _ in pending], self.p2p_timeout, self._context("the step's last sends", None)
            )
            self.wait_seconds += time.perf_counter() - start
            self.compute_seconds = time.perf_counter() - began - self.wait_seconds
            self.rows_computed = sum(self._rows_of(m) for m in range(rows // micro))
        except Exception:
            # under on_replica_loss="continue", operations never waited for stay alive
            abandon(pending + [work for works, *_ in self._awaited.values() for work in works])
            raise
        return StepResult(loss, target_tokens, token_stats, sample_ids)

    def _check_batch(self, batch: dict[str, torch.Tensor], micro: int) -> tuple[int, int]:
        input_ids = batch.get("input_ids")
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("The batch needs `input_ids` of shape (batch, sequence).")
        rows, seq_len = input_ids.shape
        for key in ("labels", "attention_mask", "position_ids"):
            value = batch.get(key)
            if value is not None and tuple(value.shape) != (rows, seq_len):
                raise ValueError(
                    f"`{key}` has shape {tuple(value.shape)} but `input_ids` has {(rows, seq_len)}: every "
                    "per-token tensor must match input_ids."
                )
        check_microbatch_size(rows, micro, what="The per-replica batch")
        return rows, seq_len

    def _index(self, rows: tuple[int, ...]) -> torch.Tensor:
        """The rows of a message as an index on the device. Sample routing draws other rows every microbatch,
        so the index is copied from pinned memory without waiting, and only the last ``_INDEX_CACHE`` sets of
        rows are kept."""
        index = self._indices.get(rows)
        if index is None:
            index = self._indices[rows] = self._on_device(torch.tensor(rows, dtype=torch.int64))
            if len(self._indices) > _INDEX_CACHE:
                self._indices.popitem(last=False)
        else:
            self._indices.move_to_end(rows)
        return index

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this stage's device, copied without waiting: from pinned memory when it is host
        memory and the device a GPU (a pageable source would block the host until the copy is done)."""
        if tensor.device.type == "cpu" and self.device.type != "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _make_meta(self, batch: dict[str, torch.Tensor], rows: int, seq_len: int) -> torch.Tensor:
        """The per-row record that travels with each activation (built on the first stage, on the device)."""
        labels = batch.get("labels")
        labels = self._on_device(batch["input_ids"] if labels is None else labels).long()
        mask = batch.get("attention_mask")
        # no mask: its slot is not read
        mask = torch.zeros_like(labels) if mask is None else self._on_device(mask).long()
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(seq_len, device=self.device).expand(rows, seq_len)
        else:
            positions = self._on_device(positions).long()
        # Sample ids are unique over the run: (per-replica sample index) * dp + origin replica.
        first = self.samples_seen * self.mesh.num_replicas + self.mesh.replica
        ids = torch.arange(rows, device=self.device).mul_(self.mesh.num_replicas).add_(first)
        target_tokens = target_token_count(labels).expand(rows)
        fixed = torch.stack([ids, target_tokens], dim=1)
        return torch.cat([fixed, labels, mask, positions], dim=1)

    def _packed_lengths(self, positions: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, int]]:
        """Per microbatch, the sequence boundaries of its packed rows run as one flat row (flash-attention's
        ``cu_seq_lens`` on the device, and ``max_length``), from the batch's positions read once per step
        on the host (a host tensor as a loader gives it: no wait at all)."""
        host = positions.cpu()
        return [
            (self._on_device(cu), longest)
            for cu, longest in (
                packed_sequence_lengths(host[start : start + micro]) for start in range(0, len(host), micro)
            )
        ]

    # ----------------------------------------------------------------------------------- communication

    def _post(self, batch: Post, outgoing: dict, arrived: dict, micro: int, seq_len: int) -> list:
        """Posts one batch of the plan: the sends of the compute just done (from ``outgoing``) and the
        receives of the next one. Nothing is waited for here: the receives where their data is used
        (:meth:`_arrived`), the sends at the end of the step. Returns the sends still in flight, with the
        tensors that must stay alive until they have left. Under ``HF_NOLOCO_STRICT_P2P`` the whole batch is
        waited for at once (NCCL's stream order, on gloo)."""
        sends = []
        for msg in batch.sends:
            tensors = outgoing[msg.phase, msg.microbatch]
            # The rows routed to this peer. Without `into` a message lists them ascending (all of them iff as
            # many); with it (capacity routing) a backward message lists them in its receiver's order.
            n = self._rows_of(msg.microbatch)
            if len(msg.rows) != n or (msg.into is not None and msg.rows != tuple(range(n))):
                index = self._index(msg.rows)
                tensors = tuple(t.index_select(0, index) for t in tensors)
            sends += [(t, msg.dst) for t in tensors]
        recvs, parts = [], []
        for msg in batch.recvs:
            buffers = self._receive_buffers(msg.phase, len(msg.rows), seq_len)
            recvs += [(t, msg.src) for t in buffers]
            parts.append((msg, buffers))
        first = (batch.recvs or batch.sends)[0]
        context = self._context(first.phase, first.microbatch)
        key = (parts[0][0].phase, parts[0][0].microbatch) if parts else None
        if strict_p2p():
            start = time.perf_counter()
            in_flight = exchange(
                sends, recvs, self.p2p_timeout, self.mesh.describe_rank, context, group=self.mesh.world_group
            )
            self.wait_seconds += time.perf_counter() - start
            if parts:
                arrived[key] = self._assemble(parts, micro)
        else:
            received, in_flight = post(sends, recvs, self.mesh.describe_rank, self.mesh.world_group)
            if parts:  # NCCL: one Work for the batch, under `received`; its sends live as long
                self._awaited[key] = (received, parts, context, sends)
        for msg in batch.sends:  # the pending sends returned below keep what is still needed
            outgoing.pop((msg.phase, msg.microbatch), None)
        return [(work, sends) for work in in_flight]

    def _arrived(self, arrived: dict, phase: str, m: int, micro: int) -> tuple[torch.Tensor, ...]:
        """The received tensors of ``(phase, m)``, waited for now, where they are first used."""
        if (phase, m) in self._awaited:
            received, parts, context, _ = self._awaited.pop((phase, m))
            start = time.perf_counter()
            try:
                wait_sends(received, self.p2p_timeout, context)
            except Exception:
                abandon(received)
                raise
            self.wait_seconds += time.perf_counter() - start
            return self._assemble(parts, micro)
        return arrived.pop((phase, m))

    def _receive_buffers(self, phase: str, rows: int, seq_len: int) -> tuple[torch.Tensor, ...]:
        layout = self._layouts[phase]
        if layout is None:
            size = (rows, seq_len, self.stage.config.hidden_size)
            values = (torch.empty(size, dtype=self.wire_dtype, device=self.device),)
        else:  # the packet's tensors, one row per sample
            values = tuple(torch.empty(rows, seq_len * n, dtype=dt, device=self.device) for dt, n in layout)
        if phase != FORWARD:
            return values
        return *values, torch.empty(rows, _META_FIXED + 3 * seq_len, dtype=torch.int64, device=self.device)

    def _encode(self, tensor: torch.Tensor, phase: str, m: int) -> tuple[torch.Tensor, ...]:
        """What leaves for a boundary tensor ``[rows, seq_len, hidden]``: its ``wire_dtype`` cast, or its
        packet with one row per sample (so that a routed message takes the rows of its samples)."""
        fmt = self.boundary_formats[phase]
        if fmt is None:
            return (tensor.detach().to(self.wire_dtype),)
        block = self.boundary_block_size if fmt in SCALED_BOUNDARY_DTYPES else None
        generator = None
        if phase == BACKWARD and self._rounding is not None:
            key = (self.router.seed, self.step_index, m, self.mesh.stage, self.mesh.replica)
            digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
            generator = self._rounding.manual_seed(int.from_bytes(digest, "little") >> 1)
        packet = encode(tensor, fmt, block, generator)
        return tuple(t.view(tensor.shape[0], -1) for t in packet)

    def _decode(
        self, received: tuple[torch.Tensor, ...], phase: str, seq_len: int, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``received`` with its leading packet decoded into one ``[rows, seq_len, hidden]`` tensor (in
        ``dtype``, default the stage's); a ``wire_dtype`` tensor is returned as it came."""
        layout = self._layouts[phase]
        if layout is None:
            return received
        packet, rest = received[: len(layout)], received[len(layout) :]
        rows = packet[0].shape[0]
        shape = (rows, seq_len, self.stage.config.hidden_size)
        tokens = tuple(t.reshape(rows * seq_len, -1) for t in packet)
        values = decode(tokens, self.boundary_formats[phase], shape, dtype or self.activation_dtype)
        return values, *rest

    def _assemble(self, parts: list, micro: int) -> tuple[torch.Tensor, ...]:
        """The microbatch's tensors from the rows each peer sent (one peer: its message is the microbatch)."""
        rows = self._rows_of(parts[0][0].microbatch)  # micro, or this replica's share under capacity routing
        only = parts[0][0]
        if len(parts) == 1 and (only.into is None or only.into == tuple(range(rows))):
            return parts[0][1]
        whole = tuple(t.new_empty(rows, *t.shape[1:]) for t in parts[0][1])
        for msg, buffers in parts:
            index = self._index(msg.into or msg.rows)
            for target, buffer in zip(whole, buffers):
                target.index_copy_(0, index, buffer)
        return whole

    def _redistribute(
        self, input_ids: torch.Tensor, meta: torch.Tensor, rows: list[list[int]], micro: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Capacity routing's first stage: per microbatch, this replica's share of the wave's input rows
        (token ids and their records), gathered from the first-stage replicas whose data shards hold them, in
        one batch of messages among the first stage posted before anything else (it cannot wait on the plan).
        Which rows go where is :func:`~hf_noloco.engine.capacity.boundary_pairs` from the shards' ``micro``
        rows each to ``rows[m]``, drawn from ``(seed, -1, step, m)``."""
        mesh, me = self.mesh, self.mesh.replica
        equal = [micro] * mesh.num_replicas
        ids_out = [input_ids.new_empty(wave[me], input_ids.shape[1]) for wave in rows]
        meta_out = [meta.new_empty(wave[me], meta.shape[1]) for wave in rows]
        sends, recvs, landing = [], [], []
        for m, wave in enumerate(rows):
            pairs = boundary_pairs(
                equal, wave, self.router.group_size, self.router.seed, -1, self.step_index, m
            )
            for (src, dst), matched in sorted(pairs.items()):
                mine = [m * micro + i for i, _ in matched]
                if src == me and dst == me:
                    index, into = self._index(tuple(mine)), self._index(tuple(j for _, j in matched))
                    ids_out[m].index_copy_(0, into, input_ids.index_select(0, index))
                    meta_out[m].index_copy_(0, into, meta.index_select(0, index))
                elif src == me:
                    index = self._index(tuple(mine))
                    peer = mesh.rank_of(dst, 0)
                    sends += [(input_ids.index_select(0, index), peer), (meta.index_select(0, index), peer)]
                elif dst == me:
                    buffers = (
                        input_ids.new_empty(len(matched), input_ids.shape[1]),
                        meta.new_empty(len(matched), meta.shape[1]),
                    )
                    peer = mesh.rank_of(src, 0)
                    recvs += [(buffers[0], peer), (buffers[1], peer)]
                    landing.append((m, tuple(j for _, j in matched), buffers))
        start = time.perf_counter()
        pending = exchange(
            sends, recvs, self.p2p_timeout, mesh.describe_rank, self._context("the input rows", None),
            group=mesh.world_group,
        )  # fmt: skip
        wait_sends(pending, self.p2p_timeout, self._context("the input rows", None))
        self.wait_seconds += time.perf_counter() - start
        for m, slots, (ids, records) in landing:
            into = self._index(slots)
            ids_out[m].index_copy_(0, into, ids)
            meta_out[m].index_copy_(0, into, records)
        return ids_out, meta_out

    def _context(self, phase: str, m: int | None) -> str:
        # Steps count from 1 in messages, as the Trainer's global_step does once the step is done.
        where = f"stage {self.mesh.stage} replica {self.mesh.replica}, step {self.step_index + 1}, {phase}"
        return where if m is None else f"{where} of microbatch {m}"


def _unpack_meta(meta: torch.Tensor, seq_len: int, has_mask: bool, has_positions: bool):
    body = meta[:, _META_FIXED:]
    mask = body[:, seq_len : 2 * seq_len] if has_mask else None
    positions = body[:, 2 * seq_len :] if has_positions else None
    return body[:, :seq_len], mask, positions
