"""No pickle on any peer path: the package holds no object collective and no pickle, every ``torch.load`` is
a ``weights_only`` one, and what a peer sends is bounded and allow-listed before anything is allocated for
it."""

import ast
import io
import os
import re

import pytest
import torch

from hf_noloco.engine.structured import (
    DTYPES,
    PeerDataError,
    checked_dtype,
    checked_shape,
    decode,
    dtype_name,
    encode,
)
from hf_noloco.resilience.transfer import _checked_markers, _split
from tests.helpers.paths import ROOT

PACKAGE = os.path.join(ROOT, "hf_noloco")
OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
# The one torch.load that is not weights_only: the local launcher reads back what its own forked children
# wrote into its private temporary folder (tests and benchmarks), never what a peer sent.
UNRESTRICTED_LOADS = {"launch/local_launch.py"}


def _sources():
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    yield os.path.relpath(path, PACKAGE), f.read()


def test_no_object_collective_and_no_pickle_in_the_package():
    found = []
    for module, text in _sources():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
                found.append(f"{module}:{node.lineno} {node.attr}")
            if isinstance(node, ast.Name) and node.id in OBJECT_COLLECTIVES:
                found.append(f"{module}:{node.lineno} {node.id}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(re.match(r"(c?pickle|dill|cloudpickle|marshal|shelve)\b", n) for n in names):
                    found.append(f"{module}:{node.lineno} imports {names}")
            value = getattr(node, "value", None) if isinstance(node, ast.Attribute) else None
            if isinstance(value, ast.Name) and value.id in ("pickle", "cPickle", "marshal"):
                found.append(f"{module}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


def test_every_torch_load_is_weights_only():
    found = []
    for module, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"):
                continue
            flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if flags.get("weights_only") != "True" and module not in UNRESTRICTED_LOADS:
                found.append(f"{module}:{node.lineno}")
    assert not found, found


def test_json_values_round_trip_and_garbage_is_refused():
    value = {"paths": ["out/checkpoint-8", None], "ok": True, "n": [1, 2.5]}
    assert decode(encode(value)) == value
    assert decode(encode(("ok", "repo"))) == ["ok", "repo"]  # JSON has lists, not tuples
    with pytest.raises(ValueError):  # not JSON: NaN is refused when encoding
        encode(float("nan"))
    for garbage in (b"\x80\x81", b"{not json", b"cos\nsystem\n(S'id'\ntR."):  # the last: a pickle
        with pytest.raises(PeerDataError):
            decode(garbage)


def test_peer_named_dtypes_and_shapes_are_checked():
    assert checked_dtype("bfloat16", "w") is torch.bfloat16
    for name in ("object", "complex128", "quint8", 3, None, "Tensor"):
        with pytest.raises(PeerDataError):
            checked_dtype(name, "w")
    assert checked_shape([3, 4], "w") == (3, 4)
    for shape in ([-1], [1.5], "3", [True], [2] * 9, [1 << 20, 1 << 20]):
        with pytest.raises(PeerDataError):
            checked_shape(shape, "w")
    with pytest.raises(ValueError):
        dtype_name(torch.complex64)
    assert set(DTYPES) >= {"float32", "bfloat16", "int64", "bool"}


def _structure(state):
    tensors = []
    return _split(state, tensors), tensors


def test_a_received_state_structure_is_checked_before_anything_is_allocated():
    state = {"w": torch.zeros(4, 3), "h": torch.zeros(2, dtype=torch.bfloat16), "step": 3}
    structure, _ = _structure(state)
    markers, sizes = _checked_markers(structure, 1 << 20, "test")
    assert sizes == [48, 4] and [m["shape"] for m in markers] == [[4, 3], [2]]
    with pytest.raises(PeerDataError, match="more than the 40 bytes"):
        _checked_markers(structure, 40, "test")  # the receiver's own bound
    bad = _structure(state)[0]
    bad["w"]["dtype"] = "object"
    with pytest.raises(PeerDataError, match="dtype"):
        _checked_markers(bad, 1 << 20, "test")
    bad = _structure(state)[0]
    bad["h"]["__hf_noloco_tensor__"] = 0  # two tensors claiming one index
    with pytest.raises(PeerDataError, match="indices"):
        _checked_markers(bad, 1 << 20, "test")
    bad = _structure(state)[0]
    bad["w"]["shape"] = [1 << 30, 1 << 30]
    with pytest.raises(PeerDataError):
        _checked_markers(bad, 1 << 62, "test")
    # The structure itself is read with weights_only: a pickle that would run code does not load.
    payload = io.BytesIO()
    torch.save({"ok": 1}, payload)
    assert torch.load(io.BytesIO(payload.getvalue()), weights_only=True) == {"ok": 1}
