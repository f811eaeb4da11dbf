"""NoLoCo against DiLoCo, DDP and no sync on the same tokens, in miniature: the paper's Table 2 and its §5.2
routing ablation, as a seeded, paired study.

A study file (``benchmarks/studies/*.yaml``; the format is in ``_study.py``) lists arms (an outer method
with its own H, alpha, beta, gamma, group size and routing), meshes, seeds, and parts to run them in. Within
one mesh and seed every arm starts from the same weights and sees the same batches, so arms are compared per
seed. Each part saves its runs (raw Trainer log histories) to ``part-<name>.json`` after every run and skips
the runs it already has, so parts can run at different times and resume; the report merges every part file.

    python benchmarks/convergence.py --list             # the parts of the study and their runs
    python benchmarks/convergence.py --part dp4xpp1     # one part (each well inside an hour on 2 cores)
    python benchmarks/convergence.py                    # every part, one after another (~2 hours)
    python benchmarks/convergence.py --replot           # tables and plots from the saved parts only
    python benchmarks/convergence.py --quick            # smoke: a tiny study in seconds (CI)

Outer hyperparameters come from the study file or the command line: ``--arm NAME=METHOD,H=8,alpha=0.5,
beta=0.7,gamma=0.7,group=2,routing=sample`` adds (or replaces) an arm; ``--arms``, ``--meshes`` and
``--seeds`` run an ad-hoc part (named by ``--part``, default ``custom``) instead of the study's parts.

Writes, in ``benchmarks/results/<study name>/`` (``--output-dir`` moves it; ``--quick``: a temporary folder):
``part-*.json`` (raw runs), ``summary.json`` (statistics), ``summary.md`` (the tables of RESULTS.md) and
``<study>_{perplexity,comparisons,divergence,routing}.png``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as common
import _report as report
import _study as study_io

STUDIES = os.path.join(common.BENCH_DIR, "studies")
DEFAULT_STUDY = os.path.join(STUDIES, "factorial.yaml")
QUICK_STUDY = os.path.join(STUDIES, "quick.yaml")


def build_study(args) -> dict:
    study = study_io.load_study(args.study or (QUICK_STUDY if args.quick else DEFAULT_STUDY))
    for text in args.arm or []:
        name, arm = study_io.parse_arm(text)
        study["arms"][name] = study_io.normalize_arm(name, arm)
    if args.steps:
        study["train"].update(max_steps=args.steps, warmup_steps=max(1, args.steps // 10))
    if args.arms or args.meshes or args.seeds:
        if not (args.arms and args.meshes and args.seeds):
            raise SystemExit("error: --arms, --meshes and --seeds go together (an ad-hoc part)")
        part = args.part or "custom"
        study["parts"] = {
            part: [
                {"mesh": m, "seeds": [int(s) for s in args.seeds.split(",")], "arms": args.arms.split(",")}
                for m in args.meshes.split(",")
            ]
        }
    study_io.check_study(study)
    return study


def write_report(study: dict, results_dir: str) -> dict:
    settings, runs = study_io.load_runs(results_dir)
    summary = report.summarize(study, settings, runs)
    summary["parameters"] = common.count_parameters(settings["model"])
    tokens_per_step = settings["train"]["global_batch"] * settings["data"]["block_size"]
    parts = sorted({r["part"] for r in runs})
    result = {
        "benchmark": "convergence",
        "study": study["name"],
        "study_file": os.path.relpath(study["path"], common.BENCH_DIR),
        "machine": settings["machine"],
        "corpus": settings["corpus"],
        "model": settings["model"],
        "parameters": summary["parameters"],
        "data": settings["data"],
        "train": settings["train"],
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_per_step * settings["train"]["max_steps"],
        "arms": {name: dict(arm) for name, arm in study["arms"].items()},
        "parts": parts,
        "num_runs": len(runs),
        "train_hours": sum(r["wall_s"] for r in runs) / 3600,
        "run_hours": sum(r.get("total_s", r["wall_s"]) for r in runs) / 3600,
        **summary,
    }
    study_io.write_json(os.path.join(results_dir, "summary.json"), result)
    tables = report.markdown(study, summary)
    with open(os.path.join(results_dir, "summary.md"), "w") as f:
        f.write(tables)
    print(tables)
    for path in report.plot(study, settings, runs, summary, os.path.join(results_dir, study["name"])):
        print("wrote", path)
    print(f"{len(runs)} runs from {len(parts)} part(s); {result['run_hours']:.2f} h of running in all")
    return result


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--study", help="study file (default benchmarks/studies/factorial.yaml)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: benchmarks/studies/quick.yaml")
    parser.add_argument("--part", help="comma-separated parts to run (default: all, in order)")
    parser.add_argument("--list", action="store_true", help="print the parts and their runs, then stop")
    parser.add_argument(
        "--arm",
        action="append",
        metavar="NAME=METHOD,key=value,...",
        help="add or replace an arm (keys: H, alpha, beta, gamma, group, routing); repeatable",
    )
    parser.add_argument("--arms", help="with --meshes and --seeds: run these arms as one ad-hoc part")
    parser.add_argument("--meshes", help="comma-separated dpxpp meshes of the ad-hoc part, e.g. 4x1,4x2")
    parser.add_argument("--seeds", help="comma-separated seeds of the ad-hoc part")
    parser.add_argument("--steps", type=int, help="override max_steps (warm-up 10%%; every H must divide it)")
    parser.add_argument("--output-dir", help="results folder (default benchmarks/results/<study name>)")
    parser.add_argument(
        "--replot",
        action="store_true",
        help="no training: merge the saved parts, redo summary.json, summary.md and the plots",
    )
    args = parser.parse_args(argv)
    study = build_study(args)
    if args.output_dir:
        results_dir = args.output_dir
    elif args.quick:
        results_dir = tempfile.mkdtemp(prefix="convergence-quick-")
    else:
        results_dir = os.path.join(common.RESULTS_DIR, study["name"])
    os.makedirs(results_dir, exist_ok=True)

    parts = args.part.split(",") if args.part else list(study["parts"])
    todo = study_io.plan(study, parts)
    if args.list:
        for part in parts:
            mine = [t for t in todo if t[0] == part]
            meshes = ", ".join(dict.fromkeys(m for _, m, _, _ in mine))
            print(f"{part}: {len(mine)} runs on {meshes}")
            for block in study["parts"][part]:
                print(f"    {block['mesh']}  seeds {block['seeds']}  {', '.join(block['arms'])}")
        return None
    if args.replot:
        return write_report(study, results_dir)

    start = time.monotonic()
    data = study["data"]
    train, eval_, _ = common.load_corpus(
        study["corpus"],
        data["block_size"],
        study["model"]["vocab_size"],
        data["eval_blocks"],
        data.get("max_docs"),
    )
    print(
        f"{study['name']}: {len(train)} train blocks, {len(eval_)} eval blocks of {data['block_size']} "
        f"tokens; "
        f"{len(todo)} runs in {len(parts)} part(s); results in {results_dir}",
        flush=True,
    )
    command = "python benchmarks/convergence.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    machine = common.machine()
    for part in parts:
        study_io.run_part(study, part, results_dir, train, eval_, machine, command)
    print(f"trained in {time.monotonic() - start:.0f} s", flush=True)
    result = write_report(study, results_dir)
    result["results_dir"] = results_dir
    return result


if __name__ == "__main__":
    main()
