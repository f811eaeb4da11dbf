"""NoLoCo (no-all-reduce low-communication training) for Hugging Face transformers."""

__version__ = "0.1.0"
__all__ = ["NoLoCoConfig", "NoLoCoTrainer", "__version__"]


def __getattr__(name: str):
    # Imported on first use: `python -m hf_noloco.column_launch` (and the other command-line modules) then
    # start without loading torch and transformers first.
    if name == "NoLoCoConfig":
        from .config import NoLoCoConfig

        return NoLoCoConfig
    if name == "NoLoCoTrainer":
        from .trainer import NoLoCoTrainer

        return NoLoCoTrainer
    raise AttributeError(f"module 'hf_noloco' has no attribute {name!r}")
