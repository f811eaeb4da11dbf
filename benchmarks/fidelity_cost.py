"""What the start-up proof of the split (``verify_split``) costs on rank 0 before training: seconds on one CPU
thread, at 8B-class configs and 4 stages.

Each config is proven ``--repeats`` times in this process (a one-process gloo group, so ``verify_split`` runs
as the trainer calls it). The first proof of the process also pays transformers' lazy imports of the family's
modules, so it is reported apart (``first``) from the median of the others. Wall seconds (``wall_*``) and
the process's CPU seconds (``cpu_*``, what a shared machine's other jobs do not inflate) are both recorded,
with the load average at the start. Where ``verify_split`` takes the run's input forms and dtype, the proof
is also measured for a run that uses fewer forms (wrapped rows and evaluation) and for bfloat16 weights. The
configs are the published ones (sizes, rotary scaling, windows), written out so that nothing is downloaded.

    python benchmarks/fidelity_cost.py --label after   # its entry of benchmarks/results/fidelity_cost.json
    python benchmarks/fidelity_cost.py --quick --out /tmp/cost.json   # Llama-3-8B only, one proof each

The file keeps one entry per ``--label`` (``before``: the proof of one form, at the commit before the proof of
every form; ``after``: this version).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# Published configs (config.json of each checkpoint), the settings that shape the forward.
CONFIGS = {
    "Llama-3-8B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "Llama-3.1-8B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "Mistral-7B-v0.1": dict(
        model_type="mistral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        sliding_window=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "gemma-2-9b": dict(
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=3584,
        intermediate_size=14336,
        num_hidden_layers=42,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        max_position_embeddings=8192,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
}


def measure(name: str, stages: int, repeats: int, **proof) -> dict:
    from transformers import AutoConfig

    from hf_noloco.engine.fidelity import verify_split

    values = dict(CONFIGS[name])
    wall, cpu = [], []
    for _ in range(repeats):
        config = AutoConfig.for_model(**values)
        start, start_cpu = time.perf_counter(), time.process_time()
        verify_split(config, stages, None, "layers", 1024, False, **proof)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    rest = slice(1, None) if repeats > 1 else slice(None)
    return {
        "config": name,
        "stages": stages,
        "proof": {k: str(v) for k, v in proof.items()} or "default",
        "wall_first_s": round(wall[0], 4),
        "wall_median_s": round(statistics.median(wall[rest]), 4),
        "cpu_first_s": round(cpu[0], 4),
        "cpu_median_s": round(statistics.median(cpu[rest]), 4),
        "repeats": repeats,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Llama-3-8B only, one proof per variant")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--label", default="after", help="the entry of the results file these rows replace")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "fidelity_cost.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.configs, args.repeats = args.configs[:1], 1

    import torch
    import torch.distributed as dist

    from benchmarks._common import machine
    from hf_noloco.engine.fidelity import verify_split
    from hf_noloco.engine.mesh import ensure_process_group

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    joined = not dist.is_initialized()
    ensure_process_group(60.0)  # verify_split is collective: a one-process group, as a plain `python` run
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    keywords = {
        p.name for p in inspect.signature(verify_split).parameters.values() if p.kind == p.KEYWORD_ONLY
    }
    variants = [{}]
    if {"forms", "dtype"} <= keywords:
        variants += [{"forms": ("unpadded", "evaluation")}, {"dtype": torch.bfloat16}]
    rows = []
    for name in args.configs:
        for proof in variants if name == args.configs[0] else [{}]:
            row = measure(name, args.stages, args.repeats, **proof)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if joined:
        dist.destroy_process_group()
    torch.set_num_threads(threads)
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results[args.label] = {
        "verify_split_keywords": sorted(keywords),
        "threads": 1,
        "load_average_1min": load,
        "machine": machine(),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out} ({args.label})")


if __name__ == "__main__":
    main()
