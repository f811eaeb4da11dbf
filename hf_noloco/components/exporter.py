"""What ``NoLoCoTrainer.save_model`` writes: the consensus model (or the LoRA adapters) as one ordinary
Hugging
Face checkpoint, with its tokenizer, model card and training curves. Collective: every rank calls
:func:`export_run`.
"""

from __future__ import annotations

import os

import torch

from hf_noloco import adapters
from hf_noloco.components.run_record import run_settings, wandb_url
from hf_noloco.io.card import PLOT_FILE, plot_training_curves, render_model_card
from hf_noloco.io.export import gather_full_state_dict, save_consensus_checkpoint
from hf_noloco.io.hub import push_folder_to_hub
from hf_noloco.rules import BUILTIN_DATASET


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
