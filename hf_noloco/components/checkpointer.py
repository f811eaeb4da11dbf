"""What a NoLoCo checkpoint holds of a run, written and read for the trainer: each rank's stage replica, its
optimizer and pipeline state, and the run's shared state (the Trainer's state, the scheduler, the mesh
record). A checkpoint resumes onto the mesh that wrote it, or onto another: other stage boundaries, another
``pipeline_stages``, another number of replicas, or the live replicas after a replica loss
(:mod:`hf_noloco.io.reshard` says what each rank reads, and what such a resume keeps).

The file layout, the atomic rename and the checksums are :mod:`hf_noloco.io.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import torch
from transformers import AutoModelForCausalLM

from hf_noloco import adapters
from hf_noloco.engine.partition import split_model
from hf_noloco.engine.stage import ties_embeddings
from hf_noloco.io import checkpoint, regather, reshard

logger = logging.getLogger(__name__)

# The model settings a checkpoint records: a resume with other values is another model, refused by name.
_MODEL_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size", "tie_word_embeddings")


class RunCheckpointer:
    """Saves and restores everything an exact resume of ``trainer``'s run needs."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._plan: tuple[reshard.SavedMesh, reshard.ReadPlan] | None = None  # a resume onto another mesh

    @property
    def layer_ranges(self) -> list[list[int]]:
        return [list(r) for r in self.trainer.model.all_layer_ranges]

    def mesh_record(self) -> dict:
        """What a resume must share with the run that saved (and, after a replica loss, the live replicas)."""
        t = self.trainer
        config = t.model.config.get_text_config()
        record = {
            "pipeline_stages": t.mesh.num_stages,
            "num_replicas": t.mesh.num_replicas,
            "layer_ranges": self.layer_ranges,
            "outer_optimizer": t.args.outer_optimizer,
            "routing": t.args.routing,
            "adapter": adapters.adapter_record(t.peft_config),
            "model": {k: getattr(config, k, None) for k in _MODEL_KEYS},
        }
        record["model"]["tie_word_embeddings"] = ties_embeddings(t.model.config)
        if t.mesh.num_live_replicas < t.mesh.num_replicas:
            record["live_replicas"] = list(t.mesh.live_replicas)
        return record

    def check_mesh_first(self, folder: str) -> None:
        """A checkpoint this run cannot continue is a likelier mistake than a damaged one: when its mesh
        record reads, say that first (the same on every rank: they read the same file). Damage is the
        checksums' job."""
        with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            checkpoint.check_mesh_record(folder, self.mesh_record())

    def save(self, run_dir: str) -> None:
        """Writes ``run_dir/checkpoint-<global step>`` (collective)."""
        t = self.trainer
        with t.mesh.patient(t.args.ddp_timeout):  # writing files may take longer than p2p_timeout
            checkpoint.write_checkpoint(
                run_dir,
                t.state.global_step,
                t.mesh,
                self._write_rank_state,
                self._write_run_state,
                timeout=t.args.ddp_timeout,
                save_total_limit=t.args.save_total_limit,
                best_model_checkpoint=t.state.best_model_checkpoint,
                barrier=t.replica_loss.checkpoint_barrier,
            )

    def _param_names(self) -> dict[str, list[str]]:
        """The names of the optimizer's parameters: by position in the inner optimizer's state dict (the order
        of its param groups) and in the outer optimizer's order. A resume onto another stage split finds each
        tensor's state by them."""
        t = self.trainer
        name_of = {id(p): n for n, p in t.model.named_parameters()}
        inner = [name_of[id(p)] for group in t.outer.param_groups for p in group["params"]]
        return {"inner": list(dict.fromkeys(inner)), "outer": [name_of[id(p)] for p in t.outer.params]}

    def rank_state(self) -> tuple[dict, dict]:
        """This rank's optimizer state (with its parameters' names) and pipeline state (routing counters,
        tokens seen, the stream position), as its checkpoint folder holds them."""
        t = self.trainer
        pipeline_state = {"engine": t.engine.state_dict(), "tokens_seen": t.throughput.state_dict()}
        stream = t.loaders.stream_state()
        if stream is not None:
            pipeline_state["stream"] = stream
        return dict(t.optimizer.state_dict(), **{regather.NAMES: self._param_names()}), pipeline_state

    def _write_rank_state(self, folder: str) -> list[str]:
        t = self.trainer
        optimizer_state, pipeline_state = self.rank_state()
        weights = checkpoint.rank_weights(t.model, trainable_only=t.peft_config is not None)
        checkpoint.save_rank_files(folder, t.mesh, weights, optimizer_state, pipeline_state)
        t._save_rng_state(folder)
        # The Trainer's name for this process's RNG file (beside the rank folders): recorded in its checksums.
        return ["rng_state.pth" if t.args.world_size <= 1 else f"rng_state_{t.args.process_index}.pth"]

    def _write_run_state(self, folder: str) -> None:
        t = self.trainer
        for callback in t.callback_handler.callbacks + [t.control]:
            if hasattr(callback, "state") and callable(callback.state):
                t.state.stateful_callbacks[type(callback).__name__] = callback.state()
        t.state.save_to_json(os.path.join(folder, "trainer_state.json"))
        torch.save(t.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        t.model.config.to_json_file(os.path.join(folder, "config.json"))
        checkpoint.write_mesh_record(folder, self.mesh_record())

    def load_model_state(self, folder: str) -> None:
        """This rank's weights, routing counters, stream position and token count from ``folder``, written by
        this mesh or another."""
        t = self.trainer
        saved = reshard.SavedMesh.of(checkpoint.check_mesh_record(folder, self.mesh_record()))
        trainable_only = t.peft_config is not None
        if saved.same_as(t.mesh.num_stages, t.mesh.num_replicas, self.layer_ranges):
            self._plan = None
            state = checkpoint.load_rank_state(folder, t.mesh, t.model, trainable_only=trainable_only)
            stream = state.get("stream")
        else:
            plan = reshard.read_plan(
                saved, t.mesh.stage, t.mesh.replica, t.mesh.num_stages, t.mesh.num_replicas, self.layer_ranges
            )
            self._plan = (saved, plan)
            if t.mesh.rank == 0:
                self._warn_mesh_change(folder, saved)
            owner = self._owner(saved)
            checkpoint.load_weights_by_name(
                folder, t.model, lambda name: (owner(name)[0], plan.replica, owner(name)[1]), trainable_only
            )
            state = checkpoint.read_rank_file(folder, 0, plan.replica, reshard.PIPELINE)
            stream = state.get("stream") if plan.carries_stream else None
            tokens = state["tokens_seen"]
            if isinstance(tokens, dict) and not (t.mesh.is_first_stage and plan.continues):
                # Counted since the last log by the saved replica's first stage: once, by its continuation.
                state["tokens_seen"] = dict(tokens, pending=None)
        t.tied.check_equal()
        t.engine.load_state_dict(state["engine"])
        t.loaders.load_stream_state(stream)
        t.throughput.load_state_dict(state["tokens_seen"])

    def _owner(self, saved: reshard.SavedMesh):
        tied = ties_embeddings(self.trainer.model.config)
        return lambda name: reshard.tensor_owner(name, saved.layer_ranges, tied)

    def _warn_mesh_change(self, folder: str, saved: reshard.SavedMesh) -> None:
        t = self.trainer
        change = reshard.describe_change(saved, t.mesh.num_stages, t.mesh.num_replicas, self.layer_ranges)
        kept = (
            "the step, the learning-rate schedule, the routing counters, each replica's weights and optimizer"
        )
        kept += " state"
        lost = "the processes' random states"
        if t.mesh.num_replicas != saved.replicas or saved.held != tuple(range(saved.replicas)):
            lost += (
                " and the data position of replicas whose shard is not their saved replica's (shards change"
                " with the replica count: a dataset's epoch continues at the same step, a stream starts over)"
            )
        logger.warning(
            "Resuming %s onto another mesh: %s. Kept: %s; not kept: %s.", folder, change, kept, lost
        )

    def load_optimizer_state(self, folder: str) -> None:
        t = self.trainer
        if self._plan is None:
            state = checkpoint.load_optimizer_state(folder, t.mesh)
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
                    t.optimizer.state_dict(), self._param_names(), sources, self._owner(saved)
                )
        state.pop(regather.NAMES, None)
        t.optimizer.load_state_dict(state)
        t.lr_scheduler.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True))

    def _rebuilt_names(self, folder: str, saved: reshard.SavedMesh, stage: int, state: dict) -> dict:
        """The parameter names of saved ``stage``'s optimizer state, for a checkpoint written before they
        were recorded: that stage built again on the meta device and grouped as the Trainer groups it (with
        and without weight decay), then checked against the saved groups' sizes and tensors' shapes."""
        t = self.trainer
        refusal = (
            f"Cannot resume {folder} onto another stage split: it was written before checkpoints recorded "
            "their optimizer's parameter names"
        )
        if t.peft_config is not None:
            raise ValueError(
                f"{refusal}, and with LoRA adapters they cannot be rebuilt. Resume it on its own mesh."
            )
        trust = (t.args.model_init_kwargs or {}).get("trust_remote_code", False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(t.model.config, trust_remote_code=trust)
        boundaries = [start for start, _ in saved.layer_ranges[1:]] or None  # one stage: no boundary
        module = split_model(model, stage, saved.stages, boundaries)
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        decay = set(t.get_decay_parameter_names(module))
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
