"""What ``NoLoCoTrainer.save_model`` writes: the consensus model (or the LoRA adapters) as one ordinary
Hugging Face checkpoint, with its tokenizer, model card and training curves; and its pushes to the Hub (the
repository prepared before training, the export and checkpoints at each save by ``hub_strategy``, the
export at the end). Collective: every rank calls these methods.

How the consensus is gathered and written is :mod:`hf_noloco.io.full_checkpoint`'s (and, for adapters,
:mod:`hf_noloco.adapters`'), the card :mod:`hf_noloco.io.card`'s, the uploads :mod:`hf_noloco.io.hub`'s.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers.utils.hub import PushInProgress

from hf_noloco.adapters.consensus import consensus_adapters
from hf_noloco.adapters.files import save_adapter, save_merged
from hf_noloco.components.metrics import Throughput
from hf_noloco.components.run_record import RunRecord, wandb_url
from hf_noloco.components.run_state import RunState
from hf_noloco.config import NoLoCoConfig
from hf_noloco.data.arguments import BUILTIN_DATASET, DataArguments
from hf_noloco.engine.loading import BuiltStage
from hf_noloco.engine.mesh import PipelineMesh
from hf_noloco.engine.stage import PipelineStage
from hf_noloco.engine.structured import broadcast_json
from hf_noloco.io.card import PLOT_FILE, plot_training_curves, render_model_card
from hf_noloco.io.export_files import publish_export, staging_folder
from hf_noloco.io.full_checkpoint import gather_full_state_dict, save_consensus_checkpoint
from hf_noloco.io.hub import (
    check_hub_settings,
    describe_hub_error,
    prepare_repository,
    push_folder_to_hub,
    upload_in_background,
)
from hf_noloco.resilience.policy import ReplicaLossPolicy

logger = logging.getLogger(__name__)


class Exporter:
    """Writes the run's export and pushes it to the Hub.

    Args:
        args: the run's config; mesh, stage: its parts; source: what the stage was built from.
        peft_config: the LoRA adapters' config (``None``: the export is the model).
        replica_loss: the run's replica-loss policy (its barrier, and its sums over the live ranks).
        throughput: the token counts the card gives; record: the run's settings for the card.
        run: the Trainer's objects (its log history and step).
        tokenizer: saved beside the model; data_args, eval_dataset: what the card names as the data.
    """

    def __init__(
        self,
        args: NoLoCoConfig,
        mesh: PipelineMesh,
        stage: PipelineStage,
        source: BuiltStage,
        peft_config,
        replica_loss: ReplicaLossPolicy,
        throughput: Throughput,
        record: RunRecord,
        run: RunState,
        tokenizer=None,
        data_args: DataArguments | None = None,
        eval_dataset=None,
    ):
        self.args, self.mesh, self.stage, self.source, self.peft_config = (
            args,
            mesh,
            stage,
            source,
            peft_config,
        )
        self.replica_loss, self.throughput, self.record, self.run = replica_loss, throughput, record, run
        self.tokenizer, self.data_args, self.eval_dataset = tokenizer, data_args, eval_dataset
        self.repo_id: str | None = None  # the Hub repository's full id, once prepared
        self.push_in_progress: PushInProgress | None = None  # the uploads of the last pushed save
        self._pushed_step: int | None = None

    def export(self, output_dir: str) -> None:
        """Writes the export of the run into ``output_dir``: the model (``export_replica``'s weights or the
        replica mean) or the PEFT adapter (merged into the model with ``merge_adapter``)."""
        args, mesh, source = self.args, self.mesh, self.source
        # The tokens counted since the last training log join the total the card gives (a sum over the ranks).
        token_sum = lambda t: self.replica_loss.live_sum(t, "all-reduce of the token counts", self.run.step)
        self.throughput.log_entries(token_sum, args.device)
        with mesh.patient(args.ddp_timeout):  # one rank writes the whole model while the others wait
            # The leader writes into a staging folder, then moves the files into place (io/export_files.py).
            staging = staging_folder(output_dir) if mesh.is_leader else output_dir
            if self.peft_config is not None:
                consensus = consensus_adapters(self.stage, mesh, replica=args.export_replica)
                first_column = mesh.replica == mesh.live_replicas[0]
                full = gather_full_state_dict(consensus if first_column else None, mesh)
                if mesh.is_leader:
                    if args.merge_adapter:
                        save_merged(staging, full, self.peft_config, source.folder)
                    else:
                        trust = (args.model_init_kwargs or {}).get("trust_remote_code", False)
                        save_adapter(
                            staging, full, self.peft_config, source.base_model, source.export_config, trust
                        )
                    if self.tokenizer is not None:
                        self.tokenizer.save_pretrained(staging)
                    self.write_model_card(output_dir, staging)
            else:
                path = save_consensus_checkpoint(
                    self.stage,
                    mesh,
                    source.export_config,
                    staging,
                    tokenizer=self.tokenizer,
                    generation_config=source.generation_config,
                    replica=args.export_replica,
                    dtype=getattr(torch, args.export_dtype) if args.export_dtype else source.weights_dtype,
                    trust_remote_code=(args.model_init_kwargs or {}).get("trust_remote_code", False),
                )
                if path is not None:
                    self.write_model_card(output_dir, staging)
            if mesh.is_leader:
                publish_export(staging, output_dir)
            self.replica_loss.barrier()

    def push_export(self, commit_message: str, token=None, revision=None) -> str | None:
        """Uploads the export in ``output_dir`` from the leader rank while the others wait (collective);
        returns the commit's URL on the leader."""
        args, mesh = self.args, self.mesh
        url = failure = None
        with mesh.patient(args.ddp_timeout):
            if mesh.is_leader:
                try:
                    url = push_folder_to_hub(
                        args.output_dir,
                        self.repo_id or args.hub_model_id,
                        token=token or args.hub_token,
                        private=args.hub_private_repo,
                        commit_message=commit_message,
                        revision=revision or args.hub_revision,
                    )
                except (OSError, ValueError) as exc:  # HfHubHTTPError is an OSError
                    failure = (
                        f"The upload to the Hub repository {self.repo_id} failed: {describe_hub_error(exc)}."
                    )
            [failure] = self._agree([failure], f"{mesh.describe()}: whether the upload succeeded")
            if failure:
                raise RuntimeError(failure)
            self.replica_loss.barrier()
        return url

    def _agree(self, message: list, what: str) -> list:
        """``message`` (a list of one JSON value) as the leader holds it, on every live rank."""
        mesh = self.mesh
        if mesh.world_size > 1:
            device = mesh.device if mesh.backend == "nccl" else torch.device("cpu")
            # No async form: bounded by the group's own timeout, ddp_timeout here (a Hub call may be slow).
            with mesh.patient(self.args.ddp_timeout):
                message = broadcast_json(message, mesh.leader, mesh.world_group, device, what=what)
        return message

    def init_repository(self, token=None, private=None) -> str:
        """Before training, on every rank: the push settings are checked, and the leader checks the token
        with the Hub and creates the repository; its verdict is every rank's (the same error everywhere, no
        hang). Returns the repository's full id."""
        args, mesh = self.args, self.mesh
        token = token or args.hub_token
        repo_id = check_hub_settings(True, args.hub_model_id, token)
        verdict = [None]
        if mesh.is_leader:
            try:
                private = private if private is not None else args.hub_private_repo
                verdict = [["ok", prepare_repository(repo_id, token, private, args.hub_revision)]]
            except ValueError as exc:
                verdict = [["error", str(exc)]]
        [(kind, value)] = self._agree(verdict, f"{mesh.describe()}: the Hub repository check")
        if kind == "error":
            raise ValueError(value)
        self.repo_id = value
        return value

    def push_checkpoint(self, checkpoint_folder: str) -> None:
        """``hub_strategy`` ``every_save``, ``checkpoint`` or ``all_checkpoints`` (collective, after each
        save): the export of this step into ``output_dir``, uploaded in the background from the leader, and
        with ``checkpoint`` the checkpoint itself to ``last-checkpoint/`` (``all_checkpoints``: to its own
        folder), for a resume elsewhere. While the previous save's upload still runs, this save is not pushed
        (the Trainer's rule), or with ``hub_always_push`` the leader waits for it first: the export must not
        rewrite files an upload is reading."""
        args, mesh = self.args, self.mesh
        strategy = str(getattr(args.hub_strategy, "value", args.hub_strategy))
        if strategy == "end":
            return
        previous = self.push_in_progress
        state = [False, None]  # [the last push still runs, what made it fail]
        if mesh.is_leader and previous is not None:
            if args.hub_always_push:
                previous.wait_until_done()
            state = [not previous.is_done(), self._failure(previous)]
        busy, failure = self._agree(state, f"{mesh.describe()}: whether the last push is done")
        if failure:
            self.push_in_progress = None
            raise RuntimeError(failure)
        if busy:
            if mesh.is_leader:
                logger.info(
                    "The previous push is still running: checkpoint %s is not pushed.", checkpoint_folder
                )
            return
        self.export(args.output_dir)
        if not mesh.is_leader:
            return
        message = f"Training in progress, step {self.run.step}"
        repo, token, revision = self.repo_id, args.hub_token, args.hub_revision
        jobs = [upload_in_background(args.output_dir, repo, message, token, revision)]
        if strategy in ("checkpoint", "all_checkpoints"):
            where = "last-checkpoint" if strategy == "checkpoint" else os.path.basename(checkpoint_folder)
            message += ", checkpoint"
            job = upload_in_background(
                checkpoint_folder, repo, message, token, revision, where, checkpoint=True
            )
            jobs.append(job)
        self.push_in_progress = PushInProgress(jobs)
        self._pushed_step = self.run.step

    def _failure(self, push: PushInProgress) -> str | None:
        """What made a finished background upload fail (its error's type and HTTP status), or ``None``."""
        for job in push.jobs:
            if job.done() and not job.cancelled() and job.exception() is not None:
                return (
                    f"The background upload of step {self._pushed_step} to the Hub repository {self.repo_id} "
                    f"failed: {describe_hub_error(job.exception())}. Check the token's rights and the "
                    "network, then push again (the export and checkpoints are in output_dir)."
                )
        return None

    def finish_uploads(self) -> None:
        """At the end (collective when pushing): waits for the last background upload, and raises on every
        rank if it failed."""
        if not self.args.push_to_hub:
            return
        mesh, push = self.mesh, self.push_in_progress
        failure = None
        if mesh.is_leader and push is not None:
            push.wait_until_done()
            failure = self._failure(push)
        [failure] = self._agree([failure], f"{mesh.describe()}: whether the last push succeeded")
        self.push_in_progress = None
        if failure:
            raise RuntimeError(failure)

    def write_model_card(self, output_dir: str, write_to: str | None = None) -> None:
        """The model card (``README.md``) and the training-curve plot of the run, from this rank, for the
        export in ``output_dir`` (written into ``write_to`` when given: the export's staging folder)."""
        history = self.run.trainer_state.log_history
        last = lambda key: next((e[key] for e in reversed(history) if key in e), None)
        folder = write_to or output_dir
        plot = plot_training_curves(history, os.path.join(folder, PLOT_FILE)) if history else None
        data = self.data_args
        render_model_card(
            output_dir,
            base_model=self.source.base_model,
            dataset=data.dataset_name if data is not None else BUILTIN_DATASET,
            dataset_config=data.dataset_config if data is not None else None,
            dataset_split=_evaluation_split(self.eval_dataset),
            settings=self.record.settings(),
            final_perplexity=last("eval_perplexity"),
            replica_divergence=last("replica_divergence"),
            mean_token_accuracy=last("eval_mean_token_accuracy"),
            tokens_seen=self.throughput.tokens_seen,
            plot_file=os.path.basename(plot) if plot else None,
            repo_id=self.repo_id,
            base_model_folder=self.source.folder,
            wandb_url=wandb_url(),
            write_to=folder,
        )


def _evaluation_split(eval_dataset) -> str | None:
    split = getattr(eval_dataset, "split", None)
    if split is None:
        return None
    # A dataset without a validation split is evaluated on documents held out of "train" (data.load_splits).
    return "train (held-out documents)" if str(split) == "train" else str(split)
