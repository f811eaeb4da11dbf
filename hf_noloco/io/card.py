"""The model card and the training-curve plot that go beside an exported checkpoint.

The card is rendered from the Jinja template ``model_cards/model_card.md`` (shipped inside the package; found
in the source checkout's top-level ``model_cards/`` folder too). Its metadata follows the Hub's conventions: a
``base_model`` only when the run started from a Hub model, the base model's license and language when its own
card states them, and the final perplexity as a ``model-index`` result naming the dataset, its config and
split.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PLOT_FILE = "training_curves.png"
_TEMPLATE_NAME = "model_card.md"


def default_template() -> Path:
    """The card template: inside the installed package, or in the source checkout's ``model_cards/``."""
    package = Path(__file__).parent.parent  # hf_noloco/
    for folder in (package / "model_cards", package.parent / "model_cards"):
        if (folder / _TEMPLATE_NAME).is_file():
            return folder / _TEMPLATE_NAME
    raise FileNotFoundError(f"The model-card template {_TEMPLATE_NAME} is missing from the installation.")


# ----------------------------------------------------------------------------------------------------------
# Training curves
# ----------------------------------------------------------------------------------------------------------

# (panel title, y label, log_history keys tried in order)
_PANELS = (
    ("Training loss", "loss", ("loss", "train_loss")),
    ("Evaluation perplexity", "perplexity", ("eval_perplexity", "perplexity")),
    ("Replica divergence", "divergence", ("replica_divergence", "eval_replica_divergence")),
)


def _series(log_history: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of the first key present in ``log_history``; non-finite values are dropped."""
    for key in keys:
        points = [
            (float(entry["step"]), float(entry[key]))
            for entry in log_history
            if key in entry
            and "step" in entry
            and isinstance(entry[key], (int, float))
            and math.isfinite(float(entry[key]))
        ]
        if points:
            # Trainer's end-of-training summary repeats keys such as `train_loss`; keep one point per step.
            by_step = dict(points)
            steps = sorted(by_step)
            return steps, [by_step[s] for s in steps]
    return [], []


def plot_training_curves(log_history: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str:
    """Writes a PNG with training loss, evaluation perplexity and replica divergence against the step.

    Args:
        log_history: a Trainer ``state.log_history``: dicts with ``step`` and some of ``loss``,
            ``eval_perplexity``, ``replica_divergence``. A metric that never appears gets a "no data" panel.
        path: the PNG to write (its folder is created).

    Returns:
        The path written.
    """
    # The object-oriented API with an Agg canvas: no pyplot global state, no GUI backend, safe in threads.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(_PANELS))
    for ax, (title, ylabel, keys) in zip(axes, _PANELS):
        steps, values = _series(log_history, keys)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if not steps:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        if ylabel == "perplexity" and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")  # early perplexities are orders of magnitude above the final ones
        ax.grid(alpha=0.3)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ----------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------

# A label for every setting the trainer reports, in display order. Settings without a value (the outer
# hyperparameters of ddp and local) are left out; keys without a label are shown as they are, after these.
SETTING_LABELS = {
    "outer_optimizer": "Method (outer optimizer)",
    "pipeline_stages": "Pipeline stages",
    "layer_ranges": "Decoder layers of each stage",
    "num_replicas": "Data-parallel replicas per stage",
    "inner_steps": "Inner steps between outer steps (H)",
    "outer_lr": "Outer learning rate (β)",
    "outer_momentum": "Outer momentum (α)",
    "outer_averaging": "Pull towards the group's slow weights (γ)",
    "gossip_group_size": "Outer group size (n)",
    "outer_dtype": "Precision of the weights sent at an outer step",
    "routing": "Routing between stages",
    "routing_domain": "Routing domain (global, or within a node)",
    "routing_group_size": "Replicas per routing group",
    "outer_overlap_steps": "Inner steps overlapping an outer exchange (τ)",
    "pipeline_schedule": "Pipeline schedule",
    "microbatch_size": "Microbatch size (sequences)",
    "global_batch_size": "Global batch (sequences per step)",
    "gradient_accumulation_steps": "Gradient accumulation (batches per step)",
    "max_length": "Sequence length (tokens)",
    "packing": "Rows (wrapped, bfd-packed or padded)",
    "max_steps": "Training steps",
    "optimizer": "Inner optimizer",
    "learning_rate": "Peak learning rate",
    "lr_scheduler_type": "Learning-rate schedule",
    "warmup_steps": "Warm-up steps",
    "weight_decay": "Weight decay",
    "max_grad_norm": "Gradient clipping (max norm)",
    "mixed_precision": "Mixed precision",
    "weights_dtype": "Weights' dtype",
    "master_weights": "Master weights of bf16 weights",
    "seed": "Seed",
    "export_replica": "Exported weights",
    "adapter": "Adapters (only they trained)",
    "export": "What this folder holds",
}

# What `NoLoCoTrainer.export_kind` means, in the card's words.
EXPORT_KINDS = {
    "model": "the whole model",
    "adapter": "a LoRA adapter (PEFT), to load on top of the base model",
    "merged": "the base model with the LoRA adapters merged into its weights",
}


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_format_value(v) for v in value)
    return str(value)


def is_hub_id(name: str | None) -> bool:
    """Whether ``name`` is a Hub repository id; a local path or the built-in corpus is not."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")) or ":" in name:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def base_model_metadata(checkpoint_folder: str | os.PathLike | None) -> dict[str, Any]:
    """``license`` and ``language`` from the base model's own card (``README.md`` in its folder), where it
    states them: the fine-tuned model inherits the base model's terms."""
    readme = os.path.join(os.fspath(checkpoint_folder), "README.md") if checkpoint_folder else None
    if readme is None or not os.path.isfile(readme):
        return {}
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(readme).data
    except Exception:  # noqa: BLE001 - a malformed base card must not stop the export
        return {}
    return {k: getattr(data, k, None) for k in ("license", "language") if getattr(data, k, None)}


def library_versions() -> dict[str, str]:
    import importlib.metadata

    versions = {}
    for name in ("hf-noloco", "transformers", "peft", "torch", "accelerate", "datasets", "tokenizers"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def render_model_card(
    output_dir: str | os.PathLike,
    *,
    base_model: str | None,
    dataset: str,
    settings: Mapping[str, Any],
    final_perplexity: float | None,
    replica_divergence: float | None,
    tokens_seen: int,
    plot_file: str | None,
    repo_id: str | None = None,
    dataset_config: str | None = None,
    dataset_split: str | None = None,
    base_model_folder: str | os.PathLike | None = None,
    wandb_url: str | None = None,
    template_path: str | os.PathLike | None = None,
    mean_token_accuracy: float | None = None,
    write_to: str | os.PathLike | None = None,
):
    """Renders the model card and writes it as ``output_dir/README.md`` (or into ``write_to``: the folder
    the export is staged in before it moves to ``output_dir``).

    Args:
        output_dir: the exported checkpoint's folder.
        base_model: the Hub id or local folder the run started from, ``None`` for a model trained from
            scratch. Only a Hub id goes into the card's metadata (``base_model``).
        dataset: the training data (a Hub dataset id goes into the card's metadata too).
        settings: the run's settings (keys of :data:`SETTING_LABELS`), shown as a table; ``export_replica``
            (``None``: replica mean) says which weights were exported, ``export`` what was exported
            (:data:`EXPORT_KINDS`: the model, a PEFT adapter, or the adapters merged into the model).
        final_perplexity: the final evaluation perplexity, ``None`` when not measured.
        replica_divergence: the replica divergence at the end, ``None`` when not measured.
        tokens_seen: training tokens processed (over all replicas).
        plot_file: the training-curve PNG (a path inside ``output_dir``, or a name relative to it), or
        ``None``. repo_id: the Hub repo the card is for (names the model and the usage snippet).
        dataset_config: the dataset's configuration name, for the ``model-index`` result.
        dataset_split: the split the perplexity was measured on, for the ``model-index`` result.
        base_model_folder: the base model's files, where its own card gives the license and language.
        wandb_url: the wandb run's page.
        template_path: another Jinja template to use (default: :func:`default_template`).
        mean_token_accuracy: the final evaluation's share of target tokens predicted right (TRL's metric),
            ``None`` when not measured.
        write_to: where ``README.md`` goes, when not ``output_dir`` (the card still names ``output_dir``).

    Returns:
        The ``huggingface_hub.ModelCard``.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    output_dir = os.fspath(output_dir)
    model_name = (repo_id or os.path.basename(os.path.normpath(output_dir)) or "model").split("/")[-1]
    dataset_on_hub = is_hub_id(dataset)
    base_on_hub = is_hub_id(base_model)
    method = str(settings.get("outer_optimizer", "noloco"))
    export = str(settings.get("export") or "model")
    tags = ["hf-noloco", "noloco", "pipeline-parallel", "low-communication", "text-generation"]
    if method not in tags:
        tags.insert(2, method)
    if export != "model":
        tags += ["lora", "peft"]
    eval_results = None
    if final_perplexity is not None and math.isfinite(final_perplexity):
        eval_results = [
            EvalResult(
                task_type="text-generation",
                dataset_type=dataset if dataset_on_hub else "custom",
                dataset_name=dataset,
                dataset_config=dataset_config,
                dataset_split=dataset_split,
                metric_type="perplexity",
                metric_name="Perplexity",
                metric_value=round(float(final_perplexity), 4),
            )
        ]
    inherited = base_model_metadata(base_model_folder)
    card_data = ModelCardData(
        library_name="peft" if export == "adapter" else "transformers",
        pipeline_tag="text-generation",
        tags=tags,
        base_model=base_model if base_on_hub else None,
        datasets=[dataset] if dataset_on_hub else None,
        model_name=model_name,
        eval_results=eval_results,
        license=inherited.get("license"),
        language=inherited.get("language"),
    )
    if plot_file is not None and os.path.dirname(plot_file):
        # The card links it relative to the repo root, i.e. output_dir.
        plot_file = os.path.relpath(os.path.abspath(plot_file), os.path.abspath(output_dir))
    export_replica = settings.get("export_replica")
    shown = {k: v for k, v in settings.items() if v is not None}
    shown["export_replica"] = "replica mean" if export_replica is None else f"replica {export_replica}"
    shown["export"] = EXPORT_KINDS.get(export, export)
    rows = [(SETTING_LABELS[k], _format_value(shown[k])) for k in SETTING_LABELS if k in shown]
    rows += [(k, _format_value(v)) for k, v in shown.items() if k not in SETTING_LABELS]
    card = ModelCard.from_template(
        card_data,
        template_path=os.fspath(template_path or default_template()),
        model_name=model_name,
        repo_id=repo_id,
        load_path=repo_id or output_dir,
        base_model=base_model,
        base_on_hub=base_on_hub,
        dataset=dataset,
        dataset_on_hub=dataset_on_hub,
        dataset_config=dataset_config,
        method=method,
        export=export,
        adapter=settings.get("adapter"),
        export_replica=export_replica,
        settings_rows=rows,
        num_stages=settings.get("pipeline_stages"),
        num_replicas=settings.get("num_replicas"),
        final_perplexity=None if final_perplexity is None else f"{final_perplexity:.3f}",
        replica_divergence=None if replica_divergence is None else f"{replica_divergence:.4g}",
        mean_token_accuracy=None if mean_token_accuracy is None else f"{mean_token_accuracy:.4f}",
        tokens_seen=f"{int(tokens_seen):,}",
        plot_file=plot_file,
        wandb_url=wandb_url,
        versions=library_versions(),
    )
    folder = os.fspath(write_to) if write_to is not None else output_dir
    os.makedirs(folder, exist_ok=True)
    card.save(os.path.join(folder, "README.md"))
    return card
