"""Trains with a recipe: `accelerate launch --config_file recipes/accelerate_configs/cpu.yaml recipes/train.py
--config recipes/llama-tiny/noloco.yaml [--key value ...]` (the same command as `hf-noloco-train`)."""

from hf_noloco.launch.cli import main

if __name__ == "__main__":
    main()
