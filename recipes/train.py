"""Launch: accelerate launch --config_file recipes/accelerate_configs/cpu.yaml recipes/train.py recipes/llama-tiny/noloco.yaml"""

from hf_noloco.cli import main

if __name__ == "__main__":
    main()
