"""What a NoLoCo checkpoint holds of a run, written and read for the trainer: each rank's stage replica, its
optimizer and pipeline state, and the run's shared state (the Trainer's state, the scheduler, the mesh
record).

The file layout, the atomic rename and the checksums are :mod:`hf_noloco.io.checkpoint`'s.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch

from hf_noloco import adapters
from hf_noloco.io import checkpoint


class RunCheckpointer:
    """Saves and restores everything an exact resume of ``trainer``'s run needs."""

    def __init__(self, trainer):
        self.trainer = trainer

    def mesh_record(self) -> dict:
        """What a resume must share with the run that saved (and, after a replica loss, the live replicas)."""
        t = self.trainer
        record = {
            "pipeline_stages": t.mesh.num_stages,
            "num_replicas": t.mesh.num_replicas,
            "layer_ranges": [list(r) for r in t.model.all_layer_ranges],
            "outer_optimizer": t.args.outer_optimizer,
            "routing": t.args.routing,
            "adapter": adapters.adapter_record(t.peft_config),
        }
        if t.mesh.num_live_replicas < t.mesh.num_replicas:
            record["live_replicas"] = list(t.mesh.live_replicas)
        return record

    def check_mesh_first(self, folder: str) -> None:
        """A checkpoint of another mesh is a likelier mistake than a damaged one: when its mesh record reads,
        say that first (the same on every rank: they read the same file). Damage is the checksums' job."""
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

    def _write_rank_state(self, folder: str) -> list[str]:
        t = self.trainer
        pipeline_state = {"engine": t.engine.state_dict(), "tokens_seen": t.throughput.state_dict()}
        stream = t.loaders.stream_state()
        if stream is not None:
            pipeline_state["stream"] = stream
        checkpoint.save_rank_state(
            folder,
            t.mesh,
            t.model,
            t.optimizer.state_dict(),
            pipeline_state,
            trainable_only=t.peft_config is not None,
        )
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
        """This rank's weights, routing counters, stream position and token count from ``folder``."""
        t = self.trainer
        checkpoint.check_mesh_record(folder, self.mesh_record())
        state = checkpoint.load_rank_state(folder, t.mesh, t.model, trainable_only=t.peft_config is not None)
        t.tied.check_equal()
        t.engine.load_state_dict(state["engine"])
        t.loaders.load_stream_state(state.get("stream"))
        t.throughput.load_state_dict(state["tokens_seen"])

    def load_optimizer_state(self, folder: str) -> None:
        t = self.trainer
        t.optimizer.load_state_dict(checkpoint.load_optimizer_state(folder, t.mesh))
        t.lr_scheduler.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True))
