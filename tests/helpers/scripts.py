"""A benchmark script's ``main(argv)`` called in the test's own process: its ranks are forked from here, so
torch and transformers start once, not once per script. What it prints is returned."""

import contextlib
import importlib.util
import io
import os
import sys

from tests.helpers.paths import ROOT

BENCHMARKS = os.path.join(ROOT, "benchmarks")


def run_main(script: str, *argv: str) -> str:
    """``python benchmarks/<script>.py ARGV``, in this process; returns its standard output."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)  # the scripts import their siblings (_common, _report, ...)
    path = os.path.join(BENCHMARKS, f"{script}.py")
    spec = importlib.util.spec_from_file_location(f"benchmark_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.main(list(argv))
    return printed.getvalue()
