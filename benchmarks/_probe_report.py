"""benchmarks/gpu_probe.sh's steps and their timeouts, and the report of their rows: one JSON file and a short
table. Imports neither torch nor the package, so that the report is written after every step in a moment,
whatever the steps did (the shell writes it again after each one: a call cut short still leaves it)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter

# (name, seconds on a GPU, seconds in the dry mode), in the order they run: the most informative first. The
# GPU column sums to 8.75 minutes at the very most; the probe's call should get 10.
STEPS = [
    ("versions", 30, 120),
    ("nccl", 60, 120),
    ("trainer", 100, 240),
    ("split", 100, 240),
    ("codecs", 45, 120),
    ("gpu_check", 90, 300),
    ("memory", 100, 240),
]


def budget(name: str, device: str) -> int:
    """The seconds step ``name`` may take on ``device``."""
    return next(gpu if device == "cuda" else dry for step, gpu, dry in STEPS if step == name)


def report(out: str, device: str) -> int:
    steps, rows = {}, []
    for name, _, _ in STEPS:
        path = os.path.join(out, "steps", f"{name}.json")
        rc_path = os.path.join(out, "steps", f"{name}.rc")
        record = {"rows": [], "data": {}}
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
        rc = None
        if os.path.exists(rc_path):
            with open(rc_path) as f:
                rc = int(f.read().strip() or -1)
        record["exit"] = rc
        if rc not in (0, None):
            why = f"timed out after {budget(name, device)} s" if rc in (124, 137) else f"exit status {rc}"
            log_path = os.path.join(out, "steps", f"{name}.log")
            tail = ""
            if os.path.exists(log_path):
                with open(log_path) as f:
                    tail = f.read()[-1200:]
            record["rows"].append(
                dict(check=f"step {name} ended", passed=False, detail=f"{why}: {tail}", tolerance=None)
            )
        steps[name] = record
        rows += [dict(step=name, **row) for row in record["rows"]]
    summary = Counter("SKIP" if r["passed"] is None else "PASS" if r["passed"] else "FAIL" for r in rows)
    result = dict(
        probe="gpu_probe",
        device=device,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        versions=steps.get("versions", {}).get("data", {}),
        summary=dict(summary),
        steps=steps,
    )
    with open(os.path.join(out, "gpu_probe.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    lines = [
        f"gpu_probe ({device}): {summary['PASS']} passed, {summary['FAIL']} failed, {summary['SKIP']} skipped"
    ]
    for row in rows:
        mark = "SKIP" if row["passed"] is None else "PASS" if row["passed"] else "FAIL"
        lines.append(f"{mark}  {row['step']:<9} {row['check']}: {row['detail'][:160]}")
    table = "\n".join(lines)
    with open(os.path.join(out, "gpu_probe.txt"), "w") as f:
        f.write(table + "\n")
    print(table)
    return 1 if summary["FAIL"] else 0


if __name__ == "__main__":  # python _probe_report.py OUT DEVICE
    sys.exit(report(sys.argv[1], sys.argv[2]))
