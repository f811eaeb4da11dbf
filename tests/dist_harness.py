"""Kept for the tests: the launcher lives in the package."""
from hf_noloco.local_launch import free_port, run_distributed  # noqa: F401
