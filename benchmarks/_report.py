"""The report of a study (see ``_study.py``): per-arm statistics over seeds, paired comparisons with 95%
intervals, the routing ablation, markdown tables and plots with error bands. Everything here reads finished
runs; nothing trains.

Per run, the curves come from its raw Trainer log history (``_common.curves``). Final perplexity is the pooled
validation perplexity at the last step (right after an outer step of every arm, as ``max_steps`` is a multiple
of every H). Replica divergence is the official RMS distance of the replicas' weights from their mean, logged
every ``log_every`` steps; "mid-interval" is its value halfway between two outer steps (logged steps that are
H/2 modulo the arm's H; with no H, every logged step), "after sync" at the outer steps (DiLoCo's replicas are
then identical; NoLoCo's only within each pair).
"""

from __future__ import annotations

import math

import _stats as stats
from _common import curves
from _study import mesh_of

QUARTERS = (0.25, 0.5, 0.75, 1.0)


def run_curves(run: dict, settings: dict) -> dict:
    train = settings["train"]
    tokens_per_step = train["global_batch"] * settings["data"]["block_size"]
    return curves(run["log_history"], tokens_per_step, mesh_of(run["mesh"])[1])


def index(runs: list[dict], settings: dict) -> dict:
    """(mesh, arm) -> {seed: curves + wall_s}."""
    out: dict = {}
    for run in runs:
        c = run_curves(run, settings)
        c["wall_s"] = run["wall_s"]
        out.setdefault((run["mesh"], run["arm"]), {})[run["seed"]] = c
    return out


def meshes_of(runs: list[dict]) -> list[str]:
    """Meshes in the order dp, then pp."""
    return sorted({r["mesh"] for r in runs}, key=lambda m: (mesh_of(m)[1], mesh_of(m)[0]))


def divergence_split(c: dict, H: int | None) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(mid-interval, after sync): (step, divergence) of the logged steps H/2 and 0 modulo H (every logged
    step is "mid-interval" without H; when no logged step is H/2 modulo H, every one between syncs is)."""
    pairs = list(zip(c["log_steps"], c["replica_divergence"]))
    if not H:
        return pairs, []
    mid = [p for p in pairs if p[0] % H == H // 2] or [p for p in pairs if p[0] % H]
    return mid, [p for p in pairs if p[0] % H == 0]


def late_mean(pairs: list[tuple[int, float]], last_step: int) -> float:
    """Mean over the last quarter of training."""
    late = [d for s, d in pairs if s > 0.75 * last_step]
    return stats.mean(late) if late else math.nan


def paired(a: dict, b: dict, value) -> dict | None:
    """``stats.paired_log_ratio`` of ``value(curves)`` over the seeds both ``a`` and ``b`` have."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    result = stats.paired_log_ratio([value(a[s]) for s in seeds], [value(b[s]) for s in seeds])
    result["seeds"] = seeds
    return result


def product(idx: dict, mesh: str, arms) -> dict | None:
    """{seed: {"final_perplexity": product over ``arms``}} for the seeds every arm has (a name: itself)."""
    names = [arms] if isinstance(arms, str) else list(arms)
    have = [idx.get((mesh, a)) for a in names]
    if any(h is None for h in have):
        return None
    seeds = set.intersection(*(set(h) for h in have))
    return {s: {"final_perplexity": math.prod(h[s]["final_perplexity"] for h in have)} for s in sorted(seeds)}


def final(c: dict) -> float:
    return c["final_perplexity"]


# ------------------------------------------------------------------------------------------------ tables


def arm_rows(study: dict, idx: dict, meshes: list[str], last_step: int) -> dict:
    """mesh -> arm -> statistics of final perplexity, divergence and wall time over seeds."""
    ref = study.get("reference")
    out = {}
    for mesh in meshes:
        rows = {}
        for name, arm in study["arms"].items():
            by_seed = idx.get((mesh, name))
            if not by_seed:
                continue
            seeds = sorted(by_seed)
            finals = [final(by_seed[s]) for s in seeds]
            mid = [late_mean(divergence_split(by_seed[s], arm["H"])[0], last_step) for s in seeds]
            after = [late_mean(divergence_split(by_seed[s], arm["H"])[1], last_step) for s in seeds]
            row = {
                "seeds": seeds,
                "final_perplexity": finals,
                "mean": stats.mean(finals),
                "std": stats.std(finals),
                "divergence_mid_interval": stats.mean(mid),
                "divergence_mid_interval_std": stats.std(mid),
                "divergence_after_sync": stats.mean(after) if arm["H"] else None,
                "wall_s": stats.mean([by_seed[s]["wall_s"] for s in seeds]),
            }
            if ref and (mesh, ref) in idx:
                row["vs_reference"] = paired(by_seed, idx[(mesh, ref)], final)
            rows[name] = row
        out[mesh] = rows
    return out


def comparison_rows(study: dict, idx: dict, meshes: list[str]) -> list[dict]:
    out = []
    for c in study["comparisons"]:
        row = {
            "name": c["name"],
            "arm": c["arm"],
            "ref": c["ref"],
            "measures": c.get("measures", ""),
            "by_mesh": {},
        }
        for mesh in meshes:
            a, b = product(idx, mesh, c["arm"]), product(idx, mesh, c["ref"])
            if a and b:
                result = paired(a, b, final)
                if result:
                    row["by_mesh"][mesh] = result
        out.append(row)
    return out


def routing_rows(study: dict, idx: dict, last_step: int) -> dict:
    """mesh -> random-routing arm -> paired ratios against the baseline (fixed) routing: replica spread (std)
    at the end, averaged over the second half, at each quarter of training; final perplexity."""
    spec = study.get("routing")
    if not spec:
        return {}
    out = {}
    for mesh in spec.get("meshes", []):
        base = idx.get((mesh, spec["baseline"]))
        if not base:
            continue
        rows = {
            spec["baseline"]: {
                "final_perplexity": [final(base[s]) for s in sorted(base)],
                "final_std": [base[s]["replica_divergence"][-1] for s in sorted(base)],
            }
        }
        for arm in spec["arms"]:
            mine = idx.get((mesh, arm))
            if not mine:
                continue
            seeds = sorted(set(mine) & set(base))
            logs = [_mean_log_ratio_after(mine[s], base[s], last_step / 2) for s in seeds]
            m, low, high = stats.interval(logs)
            rows[arm] = {
                "final_perplexity": [final(mine[s]) for s in seeds],
                "final_std": [mine[s]["replica_divergence"][-1] for s in seeds],
                "std_ratio_final": paired(mine, base, lambda c: c["replica_divergence"][-1]),
                "std_ratio_second_half": {
                    "seeds": seeds,
                    "per_seed": [math.exp(x) for x in logs],
                    "ratio": math.exp(m),
                    "low": math.exp(low),
                    "high": math.exp(high),
                    "pct": 100 * (math.exp(m) - 1),
                    "pct_low": 100 * (math.exp(low) - 1),
                    "pct_high": 100 * (math.exp(high) - 1),
                },
                "std_ratio_by_quarter": {
                    str(q): paired(mine, base, _divergence_at(_logged(base, q * last_step))) for q in QUARTERS
                },
                "perplexity_ratio_final": paired(mine, base, final),
            }
        out[mesh] = rows
    return out


def _divergence_at(step: int):
    return lambda c: c["replica_divergence"][c["log_steps"].index(step)]


def _mean_log_ratio_after(a: dict, b: dict, first_step: float) -> float:
    """Mean over the logged steps from ``first_step`` on of log(divergence of a / divergence of b)."""
    steps = [s for s in b["log_steps"] if s >= first_step]
    return stats.mean([math.log(_divergence_at(s)(a) / _divergence_at(s)(b)) for s in steps])


def _logged(by_seed: dict, step: float) -> int:
    """The logged step closest to ``step``."""
    steps = next(iter(by_seed.values()))["log_steps"]
    return min(steps, key=lambda s: abs(s - step))


def summarize(study: dict, settings: dict, runs: list[dict]) -> dict:
    for run in runs:
        if run["arm"] in study["arms"]:
            mine = {k: study["arms"][run["arm"]][k] for k in run["arm_settings"]}
            if mine != run["arm_settings"]:
                raise ValueError(
                    f"run {run['mesh']} {run['arm']} seed {run['seed']} was made with "
                    f"{run['arm_settings']}; the study file now says {mine}"
                )
    idx = index(runs, settings)
    meshes = meshes_of(runs)
    last_step = settings["train"]["max_steps"]
    return {
        "meshes": meshes,
        "arms": arm_rows(study, idx, meshes, last_step),
        "comparisons": comparison_rows(study, idx, meshes),
        "routing": routing_rows(study, idx, last_step),
        "timing": timing_rows(runs),
    }


def timing_rows(runs: list[dict]) -> dict:
    """Per part: runs, hours of running (process start to results, per run), the fastest and slowest run, the
    mean 1-minute load average of the machine at the end of its runs (where recorded), and what the part would
    take if every run were as fast as the fastest run of its mesh and arm in the whole study (the machine with
    little else to do)."""
    fastest: dict = {}
    for r in runs:
        key = (r["mesh"], r["arm"])
        fastest[key] = min(fastest.get(key, math.inf), r.get("total_s", r["wall_s"]))
    out = {}
    for part in sorted({r["part"] for r in runs}):
        mine = [r for r in runs if r["part"] == part]
        seconds = [r.get("total_s", r["wall_s"]) for r in mine]
        loads = [r["load_average"] for r in mine if "load_average" in r]
        out[part] = {
            "runs": len(mine),
            "meshes": sorted({r["mesh"] for r in mine}),
            "hours": sum(seconds) / 3600,
            "fastest_run_s": min(seconds),
            "slowest_run_s": max(seconds),
            "mean_load_average": stats.mean(loads) if loads else None,
            "hours_at_fastest": sum(fastest[(r["mesh"], r["arm"])] for r in mine) / 3600,
        }
    return out


def fmt_pct(result: dict | None, digits: int = 1) -> str:
    if not result:
        return "-"
    if math.isnan(result["pct_low"]):
        return f"{result['pct']:+.{digits}f}%"
    return f"{result['pct']:+.{digits}f}% [{result['pct_low']:+.{digits}f}, {result['pct_high']:+.{digits}f}]"


def fmt_ratio(result: dict | None) -> str:
    if not result:
        return "-"
    if math.isnan(result["low"]):
        return f"{result['ratio']:.3f}"
    return f"{result['ratio']:.3f} [{result['low']:.3f}, {result['high']:.3f}]"


def mesh_label(mesh: str) -> str:
    dp, pp = mesh_of(mesh)
    return f"dp{dp} x pp{pp}"


def markdown(study: dict, summary: dict) -> str:
    """The tables of RESULTS.md, from the summary."""
    lines = []
    ref = study.get("reference")
    lines.append(
        f"#### Final validation perplexity per arm (mean +- std over seeds; paired vs `{ref}` with 95% "
        "interval)\n"
    )
    lines.append(
        "| mesh | arm | H | alpha | final ppl | per seed | vs "
        + f"`{ref}`"
        + " | divergence, mid-interval | after sync | train s |"
    )
    lines.append("|---|---|---:|---:|---:|---|---|---:|---:|---:|")
    for mesh, rows in summary["arms"].items():
        if ref and ref not in rows:
            continue  # a mesh of the routing ablation only: it has its own table
        for name, row in rows.items():
            arm = study["arms"][name]
            if arm["routing"] != "sample":
                continue  # the routing ablation's arms have their own table
            seeds = ", ".join(f"{p:.1f}" for p in row["final_perplexity"])
            vs = "1" if name == ref else fmt_pct(row.get("vs_reference"))
            after = row["divergence_after_sync"]
            alpha = "-" if arm["alpha"] is None else arm["alpha"]
            lines.append(
                f"| {mesh_label(mesh)} | `{name}` | {arm['H'] or '-'} | {alpha} "
                f"| {row['mean']:.1f} +- {row['std']:.1f} | {seeds} | {vs} | "
                f"{row['divergence_mid_interval']:.2e} | {'-' if after is None else f'{after:.1e}'} | "
                f"{row['wall_s']:.0f} |"
            )
    lines.append("")
    lines.append(
        "#### Paired comparisons of final validation perplexity (ratio - 1, mean over seeds, 95% interval)\n"
    )
    meshes = [m for m in summary["meshes"] if any(m in c["by_mesh"] for c in summary["comparisons"])]
    lines.append("| comparison | measures | " + " | ".join(mesh_label(m) for m in meshes) + " |")
    lines.append("|---|---|" + "---|" * len(meshes))
    for c in summary["comparisons"]:
        cells = [fmt_pct(c["by_mesh"].get(m)) for m in meshes]
        lines.append(f"| {c['name']} | {c['measures']} | " + " | ".join(cells) + " |")
    if summary["routing"]:
        base = study["routing"]["baseline"]
        lines.append("")
        lines.append(
            f"#### Routing ablation: outer sync off, random routing against `{base}` (paired ratios, 95% "
            "interval)\n"
        )
        lines.append(
            "| mesh | routing arm | final ppl | final replica std | std ratio, final | std ratio, 2nd half "
            "| ppl ratio, final |"
        )
        lines.append("|---|---|---:|---:|---|---|---|")
        for mesh, rows in summary["routing"].items():
            for name, row in rows.items():
                ppl, std = row["final_perplexity"], row["final_std"]
                ppl_s = f"{stats.mean(ppl):.1f} +- {stats.std(ppl):.1f}"
                std_s = f"{stats.mean(std):.3e}"
                if name == base:
                    lines.append(f"| {mesh_label(mesh)} | `{name}` | {ppl_s} | {std_s} | 1 | 1 | 1 |")
                else:
                    lines.append(
                        f"| {mesh_label(mesh)} | `{name}` | {ppl_s} | {std_s} | "
                        f"{fmt_ratio(row['std_ratio_final'])} | {fmt_ratio(row['std_ratio_second_half'])} | "
                        f"{fmt_ratio(row['perplexity_ratio_final'])} |"
                    )
        lines.append("")
        lines.append(
            "#### Routing ablation: replica-std ratio against fixed routing over training (95% interval)\n"
        )
        lines.append(
            "| mesh | routing arm | " + " | ".join(f"{int(q * 100)}% of training" for q in QUARTERS) + " |"
        )
        lines.append("|---|---|" + "---|" * len(QUARTERS))
        for mesh, rows in summary["routing"].items():
            for name, row in rows.items():
                if name != base:
                    cells = [fmt_ratio(row["std_ratio_by_quarter"][str(q)]) for q in QUARTERS]
                    lines.append(f"| {mesh_label(mesh)} | `{name}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("#### Time per part (hours of running; the machine was shared with other jobs)\n")
    lines.append(
        "| part | runs | meshes | hours | fastest / slowest run (s) | load average | hours if every run "
        "were as fast as its fastest repeat |"
    )
    lines.append("|---|---:|---|---:|---|---:|---:|")
    timing = summary["timing"]
    for part, row in timing.items():
        load = "-" if row["mean_load_average"] is None else f"{row['mean_load_average']:.1f}"
        lines.append(
            f"| {part} | {row['runs']} | {', '.join(mesh_label(m) for m in row['meshes'])} | "
            f"{row['hours']:.2f} | {row['fastest_run_s']:.0f} / {row['slowest_run_s']:.0f} | {load} | "
            f"{row['hours_at_fastest']:.2f} |"
        )
    total = sum(r["hours"] for r in timing.values())
    fast = sum(r["hours_at_fastest"] for r in timing.values())
    lines.append(f"| all | {sum(r['runs'] for r in timing.values())} | | {total:.2f} | | | {fast:.2f} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------- plots


def _style(arm: dict) -> dict:
    default = {"noloco": "tab:red", "diloco": "tab:blue", "ddp": "black", "local": "tab:gray"}[arm["method"]]
    return {"color": arm.get("color", default), "linestyle": arm.get("linestyle", "-")}


def _band(ax, x, series, label, style, kind="std"):
    """Mean over seeds, with a band: +- one standard deviation (``std``)."""
    columns = list(zip(*series))
    m = [stats.mean(list(c)) for c in columns]
    (line,) = ax.plot(x, m, label=label, **style)
    if len(series) > 1:
        s = [stats.std(list(c)) for c in columns]
        ax.fill_between(
            x,
            [a - b for a, b in zip(m, s)],
            [a + b for a, b in zip(m, s)],
            color=line.get_color(),
            alpha=0.15,
            linewidth=0,
        )


def _ratio_band(ax, x, a_series, b_series, label, style):
    """The paired ratio a / b at each x: geometric mean over seeds with its 95% interval as a band."""
    mids, lows, highs = [], [], []
    for i in range(len(x)):
        r = stats.paired_log_ratio([s[i] for s in a_series], [s[i] for s in b_series])
        mids.append(r["ratio"])
        lows.append(r["low"])
        highs.append(r["high"])
    (line,) = ax.plot(x, mids, label=label, **style)
    if len(a_series) > 1:
        ax.fill_between(x, lows, highs, color=line.get_color(), alpha=0.15, linewidth=0)


def plot(study: dict, settings: dict, runs: list[dict], summary: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = index(runs, settings)
    params = summary.get("parameters")
    train = settings["train"]
    tokens = train["global_batch"] * settings["data"]["block_size"]
    title = (
        f"{settings['study']}: {params / 1e6:.2f}M-param Llama, " if params else f"{settings['study']}: "
    ) + f"{train['max_steps']} steps x {tokens} tokens"
    ref = study.get("reference")
    paths = []
    factorial_meshes = [
        m
        for m in summary["meshes"]
        if any(
            study["arms"][a]["routing"] == "sample" and study["arms"][a]["method"] != "local"
            for a in summary["arms"][m]
        )
    ]

    # 1. Perplexity (mean +- std over seeds) and the paired ratio to the reference arm (95% interval).
    if factorial_meshes:
        fig, axes = plt.subplots(
            len(factorial_meshes), 2, figsize=(11, 3.4 * len(factorial_meshes)), squeeze=False
        )
        for (ax, ax_r), mesh in zip(axes, factorial_meshes):
            finals = []
            for name, arm in study["arms"].items():
                by_seed = idx.get((mesh, name))
                if not by_seed or arm["routing"] != "sample":
                    continue
                seeds = sorted(by_seed)
                x = [t / 1e6 for t in by_seed[seeds[0]]["tokens"]]
                _band(ax, x, [by_seed[s]["eval_perplexity"] for s in seeds], name, _style(arm))
                finals += [final(by_seed[s]) for s in seeds]
                if ref and name != ref and (mesh, ref) in idx and arm["H"]:  # ddp, local: see the tables
                    common = sorted(set(by_seed) & set(idx[(mesh, ref)]))
                    _ratio_band(
                        ax_r,
                        x[1:],
                        [by_seed[s]["eval_perplexity"][1:] for s in common],
                        [idx[(mesh, ref)][s]["eval_perplexity"][1:] for s in common],
                        name,
                        _style(arm),
                    )
            ax.set(
                title=f"{mesh_label(mesh)}: validation perplexity (mean +- std)",
                yscale="log",
                xlabel="training tokens (millions)",
                ylabel="perplexity",
            )
            ax.set_ylim(min(finals) * 0.9, max(finals) * 3)
            ax_r.axhline(1.0, color="tab:blue", linewidth=0.8)
            ax_r.set(
                title=f"{mesh_label(mesh)}: paired ratio to {ref} (95% int.)",
                xlabel="training tokens (millions)",
                ylabel="perplexity ratio",
            )
            for a in (ax, ax_r):
                a.grid(alpha=0.3, which="both")
                a.legend(fontsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        paths.append(f"{stem}_perplexity.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    # 2. The comparisons: final paired ratio with its 95% interval, per mesh.
    comparisons = [c for c in summary["comparisons"] if c["by_mesh"]]
    if comparisons:
        fig, ax = plt.subplots(figsize=(10, 0.32 * len(comparisons) * len(factorial_meshes) + 1.5))
        y, labels, markers = 0, [], ["o", "s", "^", "D"]
        for c in reversed(comparisons):
            for k, mesh in enumerate(reversed(factorial_meshes)):
                r = c["by_mesh"].get(mesh)
                if r:
                    err = (
                        [[r["pct"] - r["pct_low"]], [r["pct_high"] - r["pct"]]]
                        if not math.isnan(r["pct_low"])
                        else None
                    )
                    ax.errorbar(
                        [r["pct"]],
                        [y],
                        xerr=err,
                        fmt=markers[k % 4],
                        color=f"C{k}",
                        capsize=3,
                        label=mesh_label(mesh) if c is comparisons[-1] else None,
                    )
                    ax.plot(
                        [100 * (v - 1) for v in r["per_seed"]],
                        [y] * len(r["per_seed"]),
                        "x",
                        color=f"C{k}",
                        alpha=0.4,
                    )
                y += 1
            labels.append((y - len(factorial_meshes) / 2 - 0.5, c["name"]))
            y += 0.6
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks([p for p, _ in labels], [n for _, n in labels], fontsize=8)
        ax.set_xlabel(
            "final validation perplexity, paired ratio - 1 (%): mean over seeds, 95% interval, x = seeds"
        )
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        paths.append(f"{stem}_comparisons.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    # 3. Replica divergence halfway between outer steps (mean +- std).
    if factorial_meshes:
        fig, axes = plt.subplots(
            1, len(factorial_meshes), figsize=(4.6 * len(factorial_meshes), 3.6), squeeze=False
        )
        for ax, mesh in zip(axes[0], factorial_meshes):
            for name, arm in study["arms"].items():
                by_seed = idx.get((mesh, name))
                if not by_seed or arm["routing"] != "sample" or arm["method"] == "ddp":
                    continue
                seeds = sorted(by_seed)
                pairs = [divergence_split(by_seed[s], arm["H"])[0] for s in seeds]
                _band(ax, [p[0] for p in pairs[0]], [[d for _, d in p] for p in pairs], name, _style(arm))
            ax.set(
                title=f"{mesh_label(mesh)}",
                yscale="log",
                xlabel="step",
                ylabel="replica divergence, mid-interval",
            )
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle(
            f"{title}\nreplica divergence halfway between outer steps (steps H/2 modulo H; ddp: 0)",
            fontsize=10,
        )
        fig.tight_layout()
        paths.append(f"{stem}_divergence.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    # 4. Routing ablation: spread, spread ratio and perplexity ratio against fixed routing.
    if summary["routing"]:
        spec = study["routing"]
        meshes = list(summary["routing"])
        fig, axes = plt.subplots(len(meshes), 3, figsize=(14, 3.4 * len(meshes)), squeeze=False)
        for row, mesh in zip(axes, meshes):
            base = idx[(mesh, spec["baseline"])]
            for name in [spec["baseline"], *spec["arms"]]:
                by_seed = idx.get((mesh, name))
                if not by_seed:
                    continue
                arm, seeds = study["arms"][name], sorted(by_seed)
                label = f"{name} ({arm['routing']})"
                _band(
                    row[0],
                    by_seed[seeds[0]]["log_steps"],
                    [by_seed[s]["replica_divergence"] for s in seeds],
                    label,
                    _style(arm),
                )
                if name == spec["baseline"]:
                    continue
                common = sorted(set(by_seed) & set(base))
                keep = [i for i, v in enumerate(base[common[0]]["replica_divergence"]) if v > 0]
                steps = [base[common[0]]["log_steps"][i] for i in keep]
                _ratio_band(
                    row[1],
                    steps,
                    [[by_seed[s]["replica_divergence"][i] for i in keep] for s in common],
                    [[base[s]["replica_divergence"][i] for i in keep] for s in common],
                    label,
                    _style(arm),
                )
                _ratio_band(
                    row[2],
                    base[common[0]]["steps"][1:],
                    [by_seed[s]["eval_perplexity"][1:] for s in common],
                    [base[s]["eval_perplexity"][1:] for s in common],
                    label,
                    _style(arm),
                )
            row[0].set(
                title=f"{mesh_label(mesh)}: replica-weight std, no outer sync (mean +- std)",
                ylabel="RMS replica divergence",
            )
            row[1].set(title="std ratio to fixed routing (95% interval)", ylabel="ratio")
            row[2].set(title="val. perplexity ratio to fixed routing (95% int.)", ylabel="ratio")
            for ax in row:
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            for ax in row[1:]:
                ax.axhline(1.0, color="black", linewidth=0.8)
        fig.suptitle(f"{title}: routing ablation", fontsize=10)
        fig.tight_layout()
        paths.append(f"{stem}_routing.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
