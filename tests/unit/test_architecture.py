"""The package's structure against docs/architecture.md: every module is in the module map, no module imports
from a higher layer, the pure modules import neither transformers nor torch.distributed, nothing below the
trainer imports it or takes it as a parameter, no module reads another module's private names; and
docs/options.md is what the docstrings generate."""

import ast
import os
import re

from hf_noloco.docstrings import is_package_field
from hf_noloco.launch.options_doc import options_page
from tests.helpers.paths import ROOT

PACKAGE = os.path.join(ROOT, "hf_noloco")
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")


def _modules() -> dict[str, str]:
    """``{"engine/mesh.py": path}`` for every module of the package."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, PACKAGE)] = path
    return found


def _doc() -> str:
    with open(ARCHITECTURE) as f:
        return f.read()


def _table_rows(heading: str) -> list[list[str]]:
    section = _doc().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def _layers() -> dict[str, int]:
    """``{"engine/": 1, "config.py": 6, ...}`` from the layer table."""
    layers = {}
    for number, places, _ in _table_rows("Layers"):
        for place in re.findall(r"`([^`]+)`", places):
            layers[place] = int(number)
    return layers


def _layer_of(module: str, layers: dict[str, int]) -> int:
    folder = module.split("/")[0] + "/" if "/" in module else None
    if folder in layers:
        return layers[folder]
    if module in layers:
        return layers[module]
    raise AssertionError(f"hf_noloco/{module} is in no layer of docs/architecture.md")


def _imports(path: str) -> list[tuple[str, int]]:
    """Absolute names this module imports, with their line (``TYPE_CHECKING`` blocks left out: never run)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import (the package imports absolutely)"
            names += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return names


def _module_of(name: str, modules: dict[str, str]) -> str | None:
    """The package module an imported name belongs to (``hf_noloco.engine.mesh.PipelineMesh`` ->
    ``engine/mesh.py``), or None for other packages."""
    if not name.startswith("hf_noloco"):
        return None
    parts = name.split(".")[1:]
    for end in range(len(parts), 0, -1):
        for candidate in ("/".join(parts[:end]) + ".py", "/".join(parts[:end]) + "/__init__.py"):
            if candidate in modules:
                return candidate
    return "__init__.py"


def test_every_module_is_in_the_module_map_and_no_other():
    documented = {re.findall(r"`([^`]+)`", row[0])[0] for row in _table_rows("Modules")}
    modules = {m for m in _modules() if not (m.endswith("__init__.py") and m != "__init__.py")}
    assert documented == modules, (sorted(modules - documented), sorted(documented - modules))


def test_no_module_imports_from_a_higher_layer():
    layers, modules = _layers(), _modules()
    problems = []
    for module, path in modules.items():
        mine = _layer_of(module, layers)
        for name, line in _imports(path):
            target = _module_of(name, modules)
            if (
                target is None
                or target == module
                or target.endswith("__init__.py")
                and target != "__init__.py"
            ):
                continue
            if _layer_of(target, layers) > mine:
                higher = _layer_of(target, layers)
                problems.append(f"hf_noloco/{module}:{line} (layer {mine}) imports {name} (layer {higher})")
    assert not problems, "\n".join(problems)


def test_pure_modules_import_neither_transformers_nor_torch_distributed():
    section = _doc().split("Pure modules:", 1)[1].split("\n\n", 1)[0]
    pure = re.findall(r"`([^`]+)`", section)
    listed = {"rules.py", "docstrings.py", "engine/shape.py", "engine/routing.py", "engine/schedule.py"}
    listed |= {"outer/gossip.py", "outer/compression.py", "outer/wire.py", "outer/checks.py"}
    listed |= {"outer/state.py", "data/arguments.py"}
    assert listed <= set(pure)
    modules = _modules()

    def reach(module, seen):  # everything the module imports, within the package too
        for name, _ in _imports(modules[module]):
            yield name
            target = _module_of(name, modules)
            if target is not None and target not in seen:
                seen.add(target)
                yield from reach(target, seen)

    for module in pure:
        for name in reach(module, {module}):
            assert not name.startswith(("transformers", "torch.distributed")), (module, name)


def test_no_component_or_resilience_module_imports_the_trainer():
    modules = _modules()
    for module, path in modules.items():
        if module.startswith(("components/", "resilience/")):
            targets = {_module_of(name, modules) for name, _ in _imports(path)}
            assert "trainer.py" not in targets, module


def test_no_function_outside_the_trainer_takes_the_trainer():
    """Components take the parts they use: no function outside ``trainer.py`` takes the trainer."""
    found = []
    for module, path in _modules().items():
        if module == "trainer.py":
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    if "trainer" in arg.arg.lower() or "Trainer" in annotation:
                        found.append(f"hf_noloco/{module}:{node.lineno} {node.name}({arg.arg})")
    assert not found, found


# Private names of other libraries the package reads, each where no public API does the job: (module, the
# expression as written) -> why. Everything else private that a module reads must be its own.
LIBRARY_INTERNALS = {
    ("engine/mesh.py", "dist.distributed_c10d._get_default_store"): "the rendezvous store (groups by name)",
    ("engine/mesh.py", "dist.distributed_c10d._world"): "torch's registry of groups (kept after an abort)",
    ("engine/mesh.py", "dist.distributed_c10d._set_pg_timeout"): "a group's timeout, changed once it is made",
    (
        "engine/mesh.py",
        "dist.group.WORLD._get_backend",
    ): "the default group's NCCL backend (to abort in one group)",
    ("engine/mesh.py", "nccl._group_start"): "aborts of every communicator inside one NCCL group",
    ("engine/mesh.py", "nccl._group_end"): "aborts of every communicator inside one NCCL group",
    ("engine/comm.py", "pg._get_backend"): "which backend moves a device's tensors in a group (NCCL or gloo)",
    ("engine/split_backward.py", "n._sequence_nr"): "autograd's order of nodes (the weight gradients' order)",
    ("engine/fidelity.py", "meta.config._attn_implementation"): "the attention kernel transformers picked",
    ("engine/loading.py", "p._is_hf_initialized"): "transformers' flag: loaded, not initialised",
    ("engine/loading.py", "wanted[name]._is_hf_initialized"): "the same flag, on a loaded tensor",
    ("engine/loading.py", "model._init_weights"): "the model's own per-module initialisation",
    ("engine/loading.py", "meta_model._init_weights"): "the model's own per-module initialisation",
    ("engine/loading.py", "sub._buffers"): "non-persistent buffers, as from_pretrained computes them",
    ("resilience/joining.py", "fake._create_internal"): "torch's stand-in process group has no public maker",
    ("launch/cli.py", "os._exit"): "the standard library's exit without clean-up (public)",
    ("resilience/policy.py", "os._exit"): "the standard library's exit without clean-up (public)",
}


def _own_names(tree) -> set[str]:
    """Every name a module defines: its functions and classes, and the attributes its methods give ``self``
    (or ``cls``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_no_module_reads_the_private_names_of_another():
    """A ``_name`` read on another object is one the same module defines (a class's own factory), or a listed
    library internal: never a private of another module of the package, of the trainer or of HF's Trainer."""
    found, used = [], set()
    for module, path in _modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        own = _own_names(tree)
        for node in ast.walk(tree):
            private = isinstance(node, ast.Attribute) and node.attr.startswith("_")
            if not private or node.attr.startswith("__"):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            key = (module, ast.unparse(node))
            if key in LIBRARY_INTERNALS:
                used.add(key)
            elif node.attr not in own:
                found.append(f"hf_noloco/{module}:{node.lineno} {key[1]}")
    assert not found, found
    assert used == set(LIBRARY_INTERNALS), sorted(set(LIBRARY_INTERNALS) - used)  # the list is kept current


def test_the_options_page_is_what_the_docstrings_say():
    with open(os.path.join(ROOT, "docs", "options.md")) as f:
        committed = f.read()
    assert committed == options_page(), "regenerate: python -m hf_noloco.launch.options_doc > docs/options.md"


def test_every_option_is_on_the_options_page():
    import dataclasses

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.data.arguments import DataArguments
    from hf_noloco.launch.arguments import ModelArguments

    page = options_page()
    for cls in (NoLoCoConfig, ModelArguments, DataArguments):
        for f in dataclasses.fields(cls):
            if f.init and is_package_field(cls, f.name):
                assert f"**`{f.name}`**" in page, (cls.__name__, f.name)
