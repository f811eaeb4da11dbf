"""Markers by folder: ``unit`` (one process, fast: ``pytest -m unit``), ``distributed`` (real gloo process
groups), ``e2e`` (the command, launchers and faults, as separate processes), ``benchmarks`` (each benchmark's
quick mode). Every test outside ``unit/`` also carries ``multiprocess``."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_KINDS = ("unit", "distributed", "e2e", "benchmarks")


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        kind = parts[1] if len(parts) > 2 and parts[0] == "tests" else None
        if kind not in _KINDS:
            raise pytest.UsageError(f"{item.nodeid}: every test lives in tests/{{{','.join(_KINDS)}}}/")
        item.add_marker(getattr(pytest.mark, kind))
        if kind != "unit":
            item.add_marker(pytest.mark.multiprocess)
