"""NoLoCo (no-all-reduce low-communication training) for Hugging Face transformers."""

from .config import NoLoCoConfig
from .trainer import NoLoCoTrainer

__version__ = "0.1.0"
__all__ = ["NoLoCoConfig", "NoLoCoTrainer", "__version__"]
