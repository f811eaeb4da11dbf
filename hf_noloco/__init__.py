"""NoLoCo (no-all-reduce low-communication training) for Hugging Face transformers.

The public names, imported on first use (so that ``python -m hf_noloco.column_launch`` and the other
command-line modules start without loading torch and transformers first):

- :class:`NoLoCoConfig`, :class:`NoLoCoTrainer`: the Trainer and its ``TrainingArguments``;
- :class:`ModelArguments`, :class:`DataArguments`: what ``hf-noloco-train`` adds (which model, which data);
- :func:`prepare_datasets`, :func:`prepare_streams`, :func:`datasets_from_args`: a run's training and
  evaluation sets;
- :func:`lora_config`: a ``peft.LoraConfig`` from TRL's option names.
"""

__version__ = "0.1.0"

_PUBLIC = {
    "NoLoCoConfig": "hf_noloco.config",
    "NoLoCoTrainer": "hf_noloco.trainer",
    "ModelArguments": "hf_noloco.launch.arguments",
    "DataArguments": "hf_noloco.data.arguments",
    "prepare_datasets": "hf_noloco.data.datasets",
    "prepare_streams": "hf_noloco.data.datasets",
    "datasets_from_args": "hf_noloco.data.datasets",
    "lora_config": "hf_noloco.adapters.settings",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hf_noloco' has no attribute {name!r}")
