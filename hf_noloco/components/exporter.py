"""What ``NoLoCoTrainer.save_model`` writes: the consensus model (or the LoRA adapters) as one ordinary
Hugging Face checkpoint, with its tokenizer, model card and training curves; and its pushes to the Hub (the
repository prepared before training, the export and checkpoints at each save by ``hub_strategy``, the
export at the end). Collective: every rank calls these functions.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from transformers.utils.hub import PushInProgress

from hf_noloco import adapters
from hf_noloco.components.run_record import run_settings, wandb_url
from hf_noloco.engine.comm import peer_call
from hf_noloco.io.card import PLOT_FILE, plot_training_curves, render_model_card
from hf_noloco.io.export import gather_full_state_dict, save_consensus_checkpoint
from hf_noloco.io.hub import (
    CHECKPOINT_IGNORE_PATTERNS,
    check_hub_settings,
    prepare_repository,
    push_folder_to_hub,
    upload_in_background,
)
from hf_noloco.rules import BUILTIN_DATASET

logger = logging.getLogger(__name__)


def export_run(trainer, output_dir: str) -> None:
    """Writes the export of ``trainer``'s run into ``output_dir``: the model (``export_replica``'s weights or
    the replica mean) or the PEFT adapter (merged into the model with ``merge_adapter``)."""
    args, mesh = trainer.args, trainer.mesh
    # The tokens counted since the last training log join the total the card gives (a sum over the ranks).
    token_sum = lambda t: trainer._live_sum(t, "all-reduce of the token counts")
    trainer.throughput.log_entries(token_sum, args.device)
    with mesh.patient(args.ddp_timeout):  # one rank writes the whole model while the others wait
        if trainer.peft_config is not None:
            consensus = adapters.consensus_adapters(trainer.model, mesh, replica=args.export_replica)
            first_column = mesh.replica == mesh.live_replicas[0]
            full = gather_full_state_dict(consensus if first_column else None, mesh)
            if mesh.is_leader:
                if args.merge_adapter:
                    adapters.save_merged(output_dir, full, trainer.peft_config, trainer.base_model_folder)
                else:
                    adapters.save_adapter(output_dir, full, trainer.peft_config, trainer.base_model)
                if trainer.processing_class is not None:
                    trainer.processing_class.save_pretrained(output_dir)
                write_model_card(trainer, output_dir)
        else:
            path = save_consensus_checkpoint(
                trainer.model,
                mesh,
                trainer.export_config,
                output_dir,
                tokenizer=trainer.processing_class,
                generation_config=trainer.base_generation_config,
                replica=args.export_replica,
                dtype=getattr(torch, args.export_dtype) if args.export_dtype else trainer.weights_dtype,
                trust_remote_code=(args.model_init_kwargs or {}).get("trust_remote_code", False),
            )
            if path is not None:
                write_model_card(trainer, output_dir)
        trainer.replica_loss.barrier()


def push_export(trainer, commit_message: str, token=None, revision=None) -> str | None:
    """Uploads the export in ``output_dir`` from the leader rank while the others wait (collective); returns
    the commit's URL on the leader."""
    args, mesh = trainer.args, trainer.mesh
    url = None
    with mesh.patient(args.ddp_timeout):
        if mesh.is_leader:
            url = push_folder_to_hub(
                args.output_dir,
                trainer.hub_model_id or args.hub_model_id,
                token=token or args.hub_token,
                private=args.hub_private_repo,
                commit_message=commit_message,
                revision=revision or args.hub_revision,
            )
        trainer.replica_loss.barrier()
    return url


def _agree(trainer, message: list, what: str) -> list:
    """``message`` (a list of one picklable value) as the leader holds it, on every live rank."""
    mesh = trainer.mesh
    if mesh.world_size > 1:
        device = mesh.device if mesh.device.type == "cuda" else torch.device("cpu")
        # No async form: bounded by the group's own timeout, ddp_timeout here (a Hub call may be slow).
        with mesh.patient(trainer.args.ddp_timeout), peer_call(what):
            dist.broadcast_object_list(message, src=mesh.leader, group=mesh.world_group, device=device)
    return message


def init_repository(trainer, token=None, private=None) -> str:
    """Before training, on every rank: the push settings are checked, and the leader checks the token with
    the Hub and creates the repository; its verdict is every rank's (the same error everywhere, no hang).
    Returns the repository's full id."""
    args, mesh = trainer.args, trainer.mesh
    token = token or args.hub_token
    repo_id = check_hub_settings(True, args.hub_model_id, token)
    verdict = [None]
    if mesh.is_leader:
        try:
            private = private if private is not None else args.hub_private_repo
            verdict = [("ok", prepare_repository(repo_id, token, private, args.hub_revision))]
        except ValueError as exc:
            verdict = [("error", str(exc))]
    [(kind, value)] = _agree(trainer, verdict, f"{mesh.describe()}: the Hub repository check")
    if kind == "error":
        raise ValueError(value)
    return value


def push_checkpoint(trainer, checkpoint_folder: str) -> None:
    """``hub_strategy`` ``every_save``, ``checkpoint`` or ``all_checkpoints`` (collective, after each save):
    the export of this step into ``output_dir``, uploaded in the background from the leader, and with
    ``checkpoint`` the checkpoint itself to ``last-checkpoint/`` (``all_checkpoints``: to its own folder),
    for a resume elsewhere. While the previous save's upload still runs, this save is not pushed (the
    Trainer's rule), or with ``hub_always_push`` the leader waits for it first: the export must not rewrite
    files an upload is reading."""
    args, mesh = trainer.args, trainer.mesh
    strategy = str(getattr(args.hub_strategy, "value", args.hub_strategy))
    if strategy == "end":
        return
    previous = getattr(trainer, "push_in_progress", None)
    busy = [mesh.is_leader and previous is not None and not previous.is_done()]
    if busy[0] and args.hub_always_push:
        previous.wait_until_done()
        busy = [False]
    if _agree(trainer, busy, f"{mesh.describe()}: whether the last push is done")[0]:
        if mesh.is_leader:
            logger.info("The previous push is still running: checkpoint %s is not pushed.", checkpoint_folder)
        return
    export_run(trainer, args.output_dir)
    if not mesh.is_leader:
        return
    message = f"Training in progress, step {trainer.state.global_step}"
    repo, token, revision = trainer.hub_model_id, args.hub_token, args.hub_revision
    jobs = [upload_in_background(args.output_dir, repo, message, token, revision)]
    if strategy in ("checkpoint", "all_checkpoints"):
        where = "last-checkpoint" if strategy == "checkpoint" else os.path.basename(checkpoint_folder)
        message += ", checkpoint"
        job = upload_in_background(
            checkpoint_folder, repo, message, token, revision, where, CHECKPOINT_IGNORE_PATTERNS
        )
        jobs.append(job)
    trainer.push_in_progress = PushInProgress(jobs)


def _evaluation_split(eval_dataset) -> str | None:
    split = getattr(eval_dataset, "split", None)
    if split is None:
        return None
    # A dataset without a validation split is evaluated on documents held out of "train" (data.load_splits).
    return "train (held-out documents)" if str(split) == "train" else str(split)


def write_model_card(trainer, output_dir: str) -> None:
    """The model card (``README.md``) and the training-curve plot of ``trainer``'s run, from this rank."""
    history = trainer.state.log_history
    last = lambda key: next((e[key] for e in reversed(history) if key in e), None)
    plot = plot_training_curves(history, os.path.join(output_dir, PLOT_FILE)) if history else None
    data = trainer.data_args
    render_model_card(
        output_dir,
        base_model=trainer.base_model,
        dataset=data.dataset_name if data is not None else BUILTIN_DATASET,
        dataset_config=data.dataset_config if data is not None else None,
        dataset_split=_evaluation_split(trainer.eval_dataset),
        settings=run_settings(trainer),
        final_perplexity=last("eval_perplexity"),
        replica_divergence=last("replica_divergence"),
        tokens_seen=trainer.throughput.tokens_seen,
        plot_file=plot,
        repo_id=trainer.hub_model_id,
        base_model_folder=trainer.base_model_folder,
        wandb_url=wandb_url(),
    )
