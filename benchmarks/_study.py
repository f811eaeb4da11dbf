"""A study: arms (an outer method with its hyperparameters and a routing) trained on meshes over seeds, split
into parts that run at different times and are merged afterwards.

A study file (YAML) holds::

    name, corpus                       what the results folder is called; the text to train on
    model                              LlamaConfig fields
    data                               block_size, eval_blocks, max_docs (null: all documents)
    train                              global_batch, microbatch_size, eval_batch, max_steps, warmup_steps, lr,
                                       log_every, eval_every
    arms                               name -> {method, H, alpha, beta, gamma, group, routing}
    reference                          the arm the per-arm table compares against (paired, per seed)
    comparisons                        [{name, arm, ref, measures}]: paired ratios of final perplexity;
                                       arm and ref may be lists (their product: [a, d] / [b, c] is an
                                       interaction)
    routing                            {baseline, arms, meshes}: the routing ablation's comparisons
    parts                              name -> [{mesh: "4x1", seeds: [...], arms: [...]}, ...]

Arm keys: ``method`` (noloco, diloco, ddp, local), ``H`` (inner steps per outer step), ``alpha`` (outer
momentum), ``beta`` (outer learning rate), ``gamma`` (noloco's pull towards the group mean; null: beta),
``group`` (noloco's gossip group size), ``routing`` (sample, step, fixed; default sample).

Every part writes ``part-<name>.json`` in the results folder after each run (the study's settings, and per run
its arm, mesh, seed, raw Trainer log history and wall time). A part that is run again skips the runs its file
already holds with the same settings, so an interrupted part resumes. :func:`load_runs` merges every part file
of a folder.
"""

from __future__ import annotations

import copy
import glob
import json
import os
import time

import yaml
from _common import train_history

OUTER_KEYS = {
    "H": "inner_steps",
    "alpha": "outer_momentum",
    "beta": "outer_lr",
    "gamma": "outer_averaging",
    "group": "gossip_group_size",
    "dtype": "outer_dtype",
}
# The stage-boundary formats (any method): activations, their gradients, values per scale.
BOUNDARY_KEYS = {
    "boundary": "boundary_dtype",
    "boundary_grad": "boundary_grad_dtype",
    "boundary_block": "boundary_block_size",
}
ARM_KEYS = ("method", "routing", *OUTER_KEYS, *BOUNDARY_KEYS)
METHODS = ("noloco", "diloco", "ddp", "local")
ROUTINGS = ("sample", "step", "fixed")
# What must be equal for runs of two part files to be compared: everything that shapes a run but its arm.
SHARED_KEYS = ("corpus", "model", "data", "train")


def mesh_of(name: str) -> tuple[int, int]:
    dp, pp = name.split("x")
    return int(dp), int(pp)


def normalize_arm(name: str, arm: dict) -> dict:
    """An arm with every key present: unset outer hyperparameters of noloco/diloco become the paper's values
    (H, alpha per method; beta 0.7; gamma = beta; pairs), those of ddp/local None; routing defaults to
    sample."""
    from hf_noloco.outer.settings import OuterSettings

    unknown = set(arm) - set(ARM_KEYS) - {"color", "linestyle", "label"}
    if unknown:
        raise ValueError(f"arm {name!r}: unknown keys {sorted(unknown)} (known: {', '.join(ARM_KEYS)})")
    method = arm.get("method")
    if method not in METHODS:
        raise ValueError(f"arm {name!r}: method must be one of {', '.join(METHODS)}, got {method!r}")
    routing = arm.get("routing", "sample")
    if routing not in ROUTINGS:
        raise ValueError(f"arm {name!r}: routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    out = {"method": method, "routing": routing}
    if method in ("noloco", "diloco"):
        if method == "diloco" and (arm.get("gamma") is not None or arm.get("group") is not None):
            raise ValueError(f"arm {name!r}: gamma and group only apply to noloco")
        # The library's own defaults and range checks (None: the paper's value for the method).
        resolved = OuterSettings(
            method,
            inner_steps=arm.get("H"),
            outer_lr=arm.get("beta"),
            outer_momentum=arm.get("alpha"),
            outer_averaging=arm.get("gamma"),
            gossip_group_size=arm.get("group", 2),
            outer_dtype=arm.get("dtype") or "float32",
        )
        out.update(
            H=resolved.inner_steps,
            alpha=resolved.outer_momentum,
            beta=resolved.outer_lr,
            gamma=resolved.outer_averaging,
            group=resolved.gossip_group_size if method == "noloco" else None,
            dtype=resolved.outer_dtype,
        )
    else:
        given = [k for k in OUTER_KEYS if arm.get(k) is not None]
        if given:
            raise ValueError(f"arm {name!r}: {method} has no outer step; drop {', '.join(given)}")
        out.update(dict.fromkeys(OUTER_KEYS))
    for key in BOUNDARY_KEYS:  # absent unless set (the arms recorded before had none)
        if arm.get(key) is not None:
            out[key] = arm[key]
    for key in ("color", "linestyle", "label"):
        if key in arm:
            out[key] = arm[key]
    return out


def parse_arm(text: str) -> tuple[str, dict]:
    """``NAME=METHOD[,key=value...]`` from the command line, e.g. ``nl=noloco,H=8,alpha=0.3,gamma=0.7``."""
    if "=" not in text:
        raise ValueError(f"--arm {text!r}: expected NAME=METHOD[,key=value...]")
    name, rest = text.split("=", 1)
    method, *pairs = rest.split(",")
    arm: dict = {"method": method.strip()}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--arm {text!r}: {pair!r} is not key=value")
        key, value = (x.strip() for x in pair.split("=", 1))
        if key not in ARM_KEYS:
            raise ValueError(f"--arm {text!r}: unknown key {key!r} (known: {', '.join(ARM_KEYS)})")
        arm[key] = value if key in ("method", "routing") else yaml.safe_load(value)
    return name.strip(), arm


def load_study(path: str) -> dict:
    with open(path) as f:
        study = yaml.safe_load(f)
    for key in ("name", "corpus", "model", "data", "train", "arms", "parts"):
        if key not in study:
            raise ValueError(f"{path}: the study file has no {key!r}")
    study["arms"] = {name: normalize_arm(name, arm) for name, arm in study["arms"].items()}
    study.setdefault("comparisons", [])
    study["path"] = path
    check_study(study)
    return study


def check_study(study: dict) -> None:
    arms = study["arms"]

    def known(name, where):
        for n in [name] if isinstance(name, str) else name:
            if n not in arms:
                raise ValueError(f"{where}: unknown arm {n!r}")

    if study.get("reference"):
        known(study["reference"], "reference")
    for c in study["comparisons"]:
        known(c["arm"], f"comparison {c['name']!r}")
        known(c["ref"], f"comparison {c['name']!r}")
    if study.get("routing"):
        known(study["routing"]["baseline"], "routing")
        known(study["routing"]["arms"], "routing")
    steps = study["train"]["max_steps"]
    for part, blocks in study["parts"].items():
        for block in blocks:
            known(block["arms"], f"part {part!r}")
            dp, _ = mesh_of(block["mesh"])
            if study["train"]["global_batch"] % dp:
                raise ValueError(f"part {part!r}: global_batch is not a multiple of dp={dp}")
            for arm in block["arms"]:
                if arms[arm]["method"] == "noloco" and dp < 2:
                    raise ValueError(f"part {part!r}: noloco needs dp >= 2")
                if arms[arm]["H"] is not None and steps % arms[arm]["H"]:
                    # The last evaluation should see every method right after an outer step.
                    raise ValueError(
                        f"part {part!r}: arm {arm!r} has H={arms[arm]['H']}, which does not divide "
                        f"max_steps={steps}"
                    )


def plan(study: dict, parts: list[str] | None = None) -> list[tuple[str, str, str, int]]:
    """(part, mesh, arm, seed) of every run of ``parts`` (all by default), in the study file's order."""
    names = parts or list(study["parts"])
    runs = []
    for part in names:
        if part not in study["parts"]:
            raise ValueError(f"unknown part {part!r}: the study has {', '.join(study['parts'])}")
        for block in study["parts"][part]:
            for seed in block["seeds"]:
                for arm in block["arms"]:
                    runs.append((part, block["mesh"], arm, seed))
    return runs


def shared_settings(study: dict) -> dict:
    return {key: copy.deepcopy(study[key]) for key in SHARED_KEYS}


def run_spec(study: dict, mesh: str, arm_name: str, seed: int) -> dict:
    """The ``_common.train_history`` spec of one run."""
    dp, pp = mesh_of(mesh)
    arm, train = study["arms"][arm_name], study["train"]
    spec = dict(
        model=study["model"],
        dp=dp,
        pp=pp,
        method=arm["method"],
        routing=arm["routing"],
        seed=seed,
        global_batch=train["global_batch"],
        microbatch_size=train.get("microbatch_size"),
        eval_batch=train["eval_batch"],
        lr=train["lr"],
        warmup_steps=train["warmup_steps"],
        max_steps=train["max_steps"],
        log_every=train["log_every"],
        eval_every=train["eval_every"],
        block_size=study["data"]["block_size"],
    )
    if arm["method"] in ("noloco", "diloco"):
        spec.update(inner_steps=arm["H"], outer_lr=arm["beta"], outer_momentum=arm["alpha"])
        if arm.get("dtype", "float32") != "float32":  # (absent from the specs of the runs recorded before)
            spec["outer_dtype"] = arm["dtype"]
    if arm["method"] == "noloco":
        spec.update(outer_averaging=arm["gamma"], gossip_group_size=arm["group"])
    for key, option in BOUNDARY_KEYS.items():
        if arm.get(key) is not None:
            spec[option] = arm[key]
    if spec["microbatch_size"] is not None:
        spec["microbatch_size"] = min(spec["microbatch_size"], train["global_batch"] // dp)
    return spec


def arm_record(arm: dict) -> dict:
    """What identifies an arm's training (its plot style left out). A float32 wire is left out too: the runs
    recorded before ``dtype`` existed were float32."""
    return {k: arm[k] for k in ARM_KEYS if k in arm and (k != "dtype" or arm.get(k) not in (None, "float32"))}


# --------------------------------------------------------------------------------------------- part files


def part_path(results_dir: str, part: str) -> str:
    return os.path.join(results_dir, f"part-{part}.json")


def write_json(path: str, data: dict) -> None:
    """Atomically (a reader never sees half a file); each run of ``data["runs"]`` on one line."""
    items = []
    for key, value in data.items():
        if key == "runs":
            body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in value)
            items.append(' "runs": [\n' + body + "\n ]")
        else:
            items.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("{\n" + ",\n".join(items) + "\n}\n")
    os.replace(tmp, path)


def read_part(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def run_part(study: dict, part: str, results_dir: str, train, eval_, machine: dict, command: str) -> dict:
    """Runs every run of ``part`` that its part file does not hold yet, saving the file after each run."""
    path = part_path(results_dir, part)
    settings = shared_settings(study)
    record = {
        "study": study["name"],
        "part": part,
        "command": command,
        "machine": machine,
        **settings,
        "runs": [],
    }
    if os.path.exists(path):
        old = read_part(path)
        if {k: old.get(k) for k in SHARED_KEYS} != settings:
            raise ValueError(f"{path} was made with other settings: move it away to run part {part!r} again")
        record["runs"] = old["runs"]
    done = {(r["mesh"], r["arm"], r["seed"]): r for r in record["runs"]}
    todo = plan(study, [part])
    for i, (_, mesh, arm_name, seed) in enumerate(todo, 1):
        arm = arm_record(study["arms"][arm_name])
        old_run = done.get((mesh, arm_name, seed))
        if old_run is not None:
            if old_run["arm_settings"] != arm:
                raise ValueError(
                    f"{path}: run {mesh} {arm_name} seed {seed} was made with {old_run['arm_settings']},"
                    f" the study now says {arm}: move the file away or rename the arm"
                )
            print(
                f"[{part} {i}/{len(todo)}] {mesh} {arm_name} seed {seed}: "
                f"already in {os.path.basename(path)}",
                flush=True,
            )
            continue
        start = time.monotonic()
        history, wall = train_history(run_spec(study, mesh, arm_name, seed), train, eval_)
        run = {
            "mesh": mesh,
            "arm": arm_name,
            "seed": seed,
            "arm_settings": arm,
            "wall_s": wall,
            "total_s": time.monotonic() - start,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "load_average": os.getloadavg()[0],  # the machine's 1-minute load when the run ended
            "log_history": history,
        }
        record["runs"].append(run)
        write_json(path, record)
        final = [h["eval_perplexity"] for h in history if "eval_perplexity" in h][-1]
        print(
            f"[{part} {i}/{len(todo)}] {mesh} {arm_name:<16} seed {seed}: final ppl {final:8.2f}  "
            f"{wall:5.0f} s",
            flush=True,
        )
    write_json(path, record)
    return record


def load_runs(results_dir: str) -> tuple[dict, list[dict]]:
    """Every run of every part file in ``results_dir``: (the shared settings, the runs). Parts made with other
    settings, or two runs of the same (mesh, arm, seed) that differ, are refused."""
    paths = sorted(glob.glob(os.path.join(results_dir, "part-*.json")))
    if not paths:
        raise FileNotFoundError(f"no part-*.json in {results_dir}")
    settings, runs, seen = None, [], {}
    for path in paths:
        part = read_part(path)
        mine = {k: part[k] for k in SHARED_KEYS}
        if settings is None:
            settings = dict(mine, study=part["study"], machine=part["machine"])
        elif mine != {k: settings[k] for k in SHARED_KEYS}:
            raise ValueError(f"{path} was made with other settings than {paths[0]}")
        for run in part["runs"]:
            key = (run["mesh"], run["arm"], run["seed"])
            if key in seen:
                if seen[key]["arm_settings"] != run["arm_settings"]:
                    raise ValueError(f"{path}: {key} differs from the same run in another part")
                continue
            run = dict(run, part=part["part"])
            seen[key] = run
            runs.append(run)
    return settings, runs
