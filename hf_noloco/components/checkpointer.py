"""What a NoLoCo checkpoint holds of a run, and when one is read: each rank's stage replica, its optimizer and
pipeline state, and the run's shared state (the Trainer's state, the scheduler, the mesh record). A checkpoint
resumes onto the mesh that wrote it, or onto another: other stage boundaries, another ``pipeline_stages``,
another number of replicas, or the live replicas after a replica loss (:mod:`hf_noloco.io.reshard` says what
each rank reads, and what such a resume keeps). A column that joins a live run is sent the same state
(:meth:`RunCheckpointer.join_state`) and resumes from it as from a checkpoint.

The file layout, the atomic rename and the checksums are :mod:`hf_noloco.io.checkpoint_files`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_noloco.adapters.settings import adapter_record
from hf_noloco.components.loaders import ReplicaLoaders
from hf_noloco.components.metrics import Throughput
from hf_noloco.components.run_state import RunState
from hf_noloco.config import NoLoCoConfig
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.pipeline import PipelineEngine
from hf_noloco.engine.stage import PipelineStage, ties_embeddings
from hf_noloco.engine.tied import TiedEmbeddings
from hf_noloco.io import checkpoint_files as checkpoint
from hf_noloco.io import regather, reshard
from hf_noloco.resilience import elastic

logger = logging.getLogger(__name__)

# The model settings a checkpoint records: a resume with other values is another model, refused by name.
_MODEL_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings")


class RunCheckpointer:
    """Saves and restores everything an exact resume of the run needs.

    Args:
        args: the run's config.
        mesh, stage, engine, tied, loaders, throughput: the run's parts whose state a checkpoint holds.
        run: the Trainer's objects (its state, optimizer and scheduler), as they are when a checkpoint is
            written or read.
        peft_config: the LoRA adapters' config (``None``: the whole model trains).
        write_rng: writes this process's random states into a checkpoint folder, in the Trainer's format.
        decay_names: the Trainer's grouping of a module's parameters (those with weight decay), for a
            checkpoint written before checkpoints recorded their optimizer's parameter names.
    """

    def __init__(
        self,
        args: NoLoCoConfig,
        mesh: PipelineMesh,
        stage: PipelineStage,
        engine: PipelineEngine,
        tied: TiedEmbeddings,
        loaders: ReplicaLoaders,
        throughput: Throughput,
        run: RunState,
        peft_config,
        write_rng: Callable[[str], None],
        decay_names: Callable[[nn.Module], list[str]],
    ):
        self.args, self.mesh, self.stage, self.engine, self.tied = args, mesh, stage, engine, tied
        self.loaders, self.throughput, self.run, self.peft_config = loaders, throughput, run, peft_config
        self.write_rng, self.decay_names = write_rng, decay_names
        self._plan: tuple[reshard.SavedMesh, reshard.ReadPlan] | None = None  # a resume onto another mesh
        self._named: str | None = None  # a folder the run named, which a restart falls back to

    @property
    def layer_ranges(self) -> list[list[int]]:
        return [list(r) for r in self.stage.all_layer_ranges]

    def mesh_record(self) -> dict:
        """What a resume must share with the run that saved (and, after a replica loss, the live replicas)."""
        mesh, config = self.mesh, self.stage.config.get_text_config()
        record = {
            "pipeline_stages": mesh.num_stages,
            "num_replicas": mesh.num_replicas,
            "layer_ranges": self.layer_ranges,
            "outer_optimizer": self.args.outer_optimizer,
            "routing": self.args.routing,
            "adapter": adapter_record(self.peft_config),
            "model": {k: getattr(config, k, None) for k in _MODEL_KEYS},
        }
        record["model"]["tie_word_embeddings"] = ties_embeddings(self.stage.config)
        if mesh.num_live_replicas < mesh.num_replicas:
            record["live_replicas"] = list(mesh.live_replicas)
        return record

    def check_mesh_first(self, folder: str) -> None:
        """A checkpoint this run cannot continue is a likelier mistake than a damaged one: when its mesh
        record reads, say that first (the same on every rank: they read the same file). Damage is the
        checksums' job."""
        with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            checkpoint.check_mesh_record(folder, self.mesh_record())

    def record_best(self, run_dir: str) -> None:
        """The checkpoint of the best ``metric_for_best_model`` so far, recorded in the Trainer's state (which
        ``save_total_limit`` then keeps)."""
        state = self.run.trainer_state
        best = state.best_global_step  # set by the Trainer when metric_for_best_model improves
        if best and self.args.save_strategy in ("steps", "epoch", "best"):
            folder = os.path.join(run_dir, f"{checkpoint.PREFIX_CHECKPOINT_DIR}-{best}")
            if best == state.global_step or os.path.isdir(folder):
                state.best_model_checkpoint = folder

    def save(self, run_dir: str, barrier: Callable[[], None] | None = None) -> None:
        """Writes ``run_dir/checkpoint-<global step>`` (collective; ``barrier``: how the ranks meet, see
        :func:`~hf_noloco.io.checkpoint_files.write_checkpoint`)."""
        args, state = self.args, self.run.trainer_state
        with self.mesh.patient(args.ddp_timeout):  # writing files may take longer than p2p_timeout
            checkpoint.write_checkpoint(
                run_dir,
                state.global_step,
                self.mesh,
                self._write_rank_state,
                self._write_run_state,
                timeout=args.ddp_timeout,
                save_total_limit=args.save_total_limit,
                best_model_checkpoint=state.best_model_checkpoint,
                barrier=barrier,
            )

    def _param_names(self) -> dict[str, list[str]]:
        """The names of the optimizer's parameters: by position in the inner optimizer's state dict (the order
        of its param groups) and in the outer optimizer's order. A resume onto another stage split finds each
        tensor's state by them."""
        outer = self.run.outer
        name_of = {id(p): n for n, p in self.stage.named_parameters()}
        inner = [name_of[id(p)] for group in outer.param_groups for p in group["params"]]
        return {"inner": list(dict.fromkeys(inner)), "outer": [name_of[id(p)] for p in outer.params]}

    def rank_state(self) -> tuple[dict, dict]:
        """This rank's optimizer state (with its parameters' names) and pipeline state (routing counters,
        tokens seen, the stream position), as its checkpoint folder holds them."""
        pipeline_state = {"engine": self.engine.state_dict(), "tokens_seen": self.throughput.state_dict()}
        stream = self.loaders.stream_state()
        if stream is not None:
            pipeline_state["stream"] = stream
        optimizer_state = self.run.optimizer.state_dict()
        return dict(optimizer_state, **{regather.NAMES: self._param_names()}), pipeline_state

    def _write_rank_state(self, folder: str) -> list[str]:
        optimizer_state, pipeline_state = self.rank_state()
        weights = checkpoint.rank_weights(self.stage, trainable_only=self.peft_config is not None)
        checkpoint.save_rank_files(folder, self.mesh, weights, optimizer_state, pipeline_state)
        self.write_rng(folder)
        # The Trainer's name for this process's RNG file (beside the rank folders): recorded in its checksums.
        args = self.args
        return ["rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"]

    def _write_run_state(self, folder: str) -> None:
        self.run.trainer_state.save_to_json(os.path.join(folder, "trainer_state.json"))
        torch.save(self.run.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        self.stage.config.to_json_file(os.path.join(folder, "config.json"))
        checkpoint.write_mesh_record(folder, self.mesh_record())

    # ------------------------------------------------------------------------------ a column that joins

    def join_state(self) -> tuple[dict, int]:
        """Everything a checkpoint of this rank's folder holds, as one state a joining column is sent
        (:class:`~hf_noloco.resilience.live_replicas.JoinState`), and the step."""
        optimizer_state, pipeline_state = self.rank_state()
        pipeline_state["tokens_seen"] = dict(pipeline_state["tokens_seen"], pending=None)  # counted here
        trainer_state = self.run.trainer_state
        state = {
            "weights": checkpoint.rank_weights(self.stage, trainable_only=self.peft_config is not None),
            "optimizer": optimizer_state,
            "pipeline": pipeline_state,
            "trainer_state": json.dumps(dataclasses.asdict(trainer_state)),
            "scheduler": self.run.lr_scheduler.state_dict(),
        }
        return state, trainer_state.global_step

    def write_join_state(self, state: dict) -> tuple[str, int]:
        """A state received from a donor, written as a checkpoint of this rank into a private folder (which
        the resume reads); returns the folder and the state's step."""
        folder = tempfile.mkdtemp(prefix=f"hf_noloco-join-rank{self.mesh.rank}-")
        checkpoint.save_rank_files(folder, self.mesh, state["weights"], state["optimizer"], state["pipeline"])
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            f.write(state["trainer_state"])
        torch.save(state["scheduler"], os.path.join(folder, "scheduler.pt"))
        checkpoint.write_mesh_record(folder, self.mesh_record())
        return folder, json.loads(state["trainer_state"])["global_step"]

    # ------------------------------------------------------------------------------------------ resuming

    def resume_request(self, requested, joined: str | None) -> tuple[object, bool, bool]:
        """What a run asks to resume, before anything is read: ``(requested, restarted, auto)``.
        ``requested``: ``resume_from_checkpoint`` (a folder, ``True`` for the newest intact checkpoint in
        ``output_dir``, ``"auto"`` for that one if any); ``joined``: a joined column's copy of its donor's
        state, which wins. Workers a launcher restarted after a failure ask for the newest intact checkpoint
        by themselves, even when the run named a folder (which they resume only when ``output_dir`` holds
        none); a restart before any save starts over. A fresh start into an ``output_dir`` that
        holds checkpoints is refused."""
        args, mesh = self.args, self.mesh
        auto = requested == "auto" and not joined  # a requeued job resumes, a first one starts
        restarted = auto or not joined and elastic.agreed_restart(mesh)
        self._named = None
        if restarted and not auto:
            # Also after an explicit folder: the restart continues what this job saved since, not the folder.
            self._named = requested if isinstance(requested, str) else None
            logger.warning(
                "%s: a restart of this job: resuming from the newest intact checkpoint in %s%s.",
                mesh.describe(),
                args.output_dir,
                f", else {requested}" if self._named else ", if any",
            )
            requested = True
        if not (requested or joined) and checkpoint.checkpoints_in(args.output_dir):
            raise ValueError(
                f"{args.output_dir} already holds checkpoints of a run. Resume it with "
                "resume_from_checkpoint=True (or 'auto', for a fresh output_dir too), or choose another one."
            )
        return requested, restarted, auto

    def resume_folder(self, requested, restarted: bool, auto: bool, joined: str | None) -> str | None:
        """The folder to resume from (:meth:`resume_request`'s answer), every file it reads verified on every
        rank first (collective), or ``None`` for a fresh start."""
        args, mesh = self.args, self.mesh
        if joined or not requested:
            return joined
        if requested is not True and not auto:
            self.check_mesh_first(requested)
        with mesh.patient(args.ddp_timeout):  # hashing a large checkpoint may take a while
            found = checkpoint.resolve_resume(
                args.output_dir, True if auto else requested, mesh, self.stage.all_layer_ranges
            )
            if found is None and restarted and self._named:  # nothing saved since the named folder
                found = checkpoint.resolve_resume(
                    args.output_dir, self._named, mesh, self.stage.all_layer_ranges
                )
        if found is None and not restarted:  # a restart before any save starts over
            raise ValueError(f"resume_from_checkpoint=True: {args.output_dir} holds no checkpoint.")
        if restarted and mesh.rank == 0:
            what = f"resuming {found}." if found else "no checkpoint yet, from step 0."
            logger.warning("%s: %s", "resume_from_checkpoint=auto" if auto else "Restarted job", what)
        return found

    def load_model_state(self, folder: str) -> None:
        """This rank's weights, routing counters, stream position and token count from ``folder``, written by
        this mesh or another."""
        mesh = self.mesh
        saved = reshard.SavedMesh.of(checkpoint.check_mesh_record(folder, self.mesh_record()))
        trainable_only = self.peft_config is not None
        if saved.same_as(mesh.num_stages, mesh.num_replicas, self.layer_ranges):
            self._plan = None
            state = checkpoint.load_rank_state(folder, mesh, self.stage, trainable_only=trainable_only)
            stream = state.get("stream")
        else:
            plan = reshard.read_plan(
                saved, mesh.stage, mesh.replica, mesh.num_stages, mesh.num_replicas, self.layer_ranges
            )
            self._plan = (saved, plan)
            if mesh.rank == 0:
                self._warn_mesh_change(folder, saved)
            owner = self._owner(saved)
            where = lambda name: (owner(name)[0], plan.replica, owner(name)[1])  # saved stage, replica, name
            checkpoint.load_weights_by_name(folder, self.stage, where, trainable_only)
            state = checkpoint.read_rank_file(folder, 0, plan.replica, reshard.PIPELINE)
            stream = state.get("stream") if plan.carries_stream else None
            tokens = state["tokens_seen"]
            if isinstance(tokens, dict) and not (mesh.is_first_stage and plan.continues):
                # Counted since the last log by the saved replica's first stage: once, by its continuation.
                state["tokens_seen"] = dict(tokens, pending=None)
        self.tied.check_equal()
        self.engine.load_state_dict(state["engine"])
        self.loaders.load_stream_state(stream)
        self.throughput.load_state_dict(state["tokens_seen"])

    def _owner(self, saved: reshard.SavedMesh):
        tied = ties_embeddings(self.stage.config)
        return lambda name: reshard.tensor_owner(name, saved.layer_ranges, tied)

    def _warn_mesh_change(self, folder: str, saved: reshard.SavedMesh) -> None:
        mesh = self.mesh
        change = reshard.describe_change(saved, mesh.num_stages, mesh.num_replicas, self.layer_ranges)
        kept = (
            "the step, the learning-rate schedule, the routing counters, each replica's weights and optimizer"
        )
        kept += " state"
        lost = "the processes' random states"
        if mesh.num_replicas != saved.replicas or saved.held != tuple(range(saved.replicas)):
            lost += (
                " and the data position of replicas whose shard is not their saved replica's (shards change"
                " with the replica count: a dataset's epoch continues at the same step, a stream starts over)"
            )
        logger.warning(
            "Resuming %s onto another mesh: %s. Kept: %s; not kept: %s.", folder, change, kept, lost
        )

    def load_optimizer_state(self, folder: str) -> None:
        optimizer = self.run.optimizer
        if self._plan is None:
            state = checkpoint.load_optimizer_state(folder, self.mesh)
        else:
            saved, plan = self._plan
            if plan.as_saved:  # the same tensors in the same order: the saved positions are this stage's
                state = checkpoint.read_rank_file(folder, plan.stages[0], plan.replica, reshard.OPTIMIZER)
            else:
                sources = {
                    s: checkpoint.read_rank_file(folder, s, plan.replica, reshard.OPTIMIZER)
                    for s in plan.stages
                }
                for s, source in sources.items():
                    if regather.NAMES not in source:
                        source[regather.NAMES] = self._rebuilt_names(folder, saved, s, source)
                state = regather.regather_optimizer_state(
                    optimizer.state_dict(), self._param_names(), sources, self._owner(saved)
                )
        state.pop(regather.NAMES, None)
        optimizer.load_state_dict(state)
        scheduler = torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True)
        self.run.lr_scheduler.load_state_dict(scheduler)

    def _rebuilt_names(self, folder: str, saved: reshard.SavedMesh, stage: int, state: dict) -> dict:
        """The parameter names of saved ``stage``'s optimizer state, for a checkpoint written before they
        were recorded: that stage built again on the meta device and grouped as the Trainer groups it (with
        and without weight decay), then checked against the saved groups' sizes and tensors' shapes."""
        refusal = (
            f"Cannot resume {folder} onto another stage split: it was written before checkpoints recorded "
            "their optimizer's parameter names"
        )
        if self.peft_config is not None:
            raise ValueError(
                f"{refusal}, and with LoRA adapters they cannot be rebuilt. Resume it on its own mesh."
            )
        trust = (self.args.model_init_kwargs or {}).get("trust_remote_code", False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.stage.config, trust_remote_code=trust)
        boundaries = [start for start, _ in saved.layer_ranges[1:]] or None  # one stage: no boundary
        module = split_model(model, stage, saved.stages, boundaries)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        decay = set(self.decay_names(module))
        groups = [[n for n, _ in params if n in decay], [n for n, _ in params if n not in decay]]
        shapes = {n: p.shape for n, p in params}
        inner = groups[0] + groups[1]
        sizes = [len(g["params"]) for g in state["param_groups"]]
        fits = sizes == [len(g) for g in groups] and all(
            v.shape == shapes[inner[i]]
            for i, entry in state["state"].items()
            for v in entry.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        phi = state.get("outer", {}).get("phi") or []
        fits = fits and (not phi or [tuple(v.shape) for v in phi] == [tuple(p.shape) for _, p in params])
        if not fits:
            raise ValueError(
                f"{refusal}, and its optimizer state does not fit the order rebuilt from the model (param "
                f"groups of {sizes} parameters, rebuilt {[len(g) for g in groups]}). Resume it on its own "
                "mesh and save once: later checkpoints record the names."
            )
        return {"inner": inner, "outer": [n for n, _ in params]}
