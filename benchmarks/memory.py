"""Peak memory of one pipeline stage on CPU, measured, against hf_noloco.estimate.memory's prediction.

Real model configurations (Llama-3.2-1B whole; Llama-3.1-8B and Qwen3-8B with fewer layers, so that a stage
fits this machine; real hidden, MLP, head and vocabulary sizes), built on the meta device with only the
measured stage materialised, random weights. Each case runs in a fresh process that trains its stage as its
rank would: the stage's 1F1B (or GPipe) order of microbatch forwards and backwards (stage inputs and the
gradients of its outputs are random tensors standing in for its neighbours' messages; the last stage computes
the engine's loss), the column-norm clipping, fused AdamW and, for the outer-state cases, DiLoCo's outer state
and outer step (with one replica: the same float32 state as NoLoCo). Three steps: the first creates the
optimizer state, the second runs the outer step.

Measured: the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs) above its
resident memory before the stage is materialised, with glibc's mmap threshold fixed at 128 KiB so that freed
tensors go back to the system at once (otherwise freed memory lingers in malloc's heap and the resident size
overstates what is live). Separately, the peak above the static memory (weights, gradients, optimizer and
outer state) during a third forward and backward: the activations. Each prediction must be within 15% of its
measurement.

Memory: the machine is shared. Before each case the free memory (MemAvailable) must exceed the predicted peak
by 2 GiB plus 30%, or the case is skipped and reported so; cases run one at a time.

    python benchmarks/memory.py                     # every case (about 30-60 minutes on 2 busy cores)
    python benchmarks/memory.py --only 1b-s1-fp32   # some cases (names below), merged into the results
    python benchmarks/memory.py --quick             # smoke: a tiny model, its two cases at once
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(BENCH_DIR, "results", "memory.json")
sys.path.insert(0, os.path.dirname(BENCH_DIR))

GIB = 2**30
TOLERANCE = 0.15

# The published configurations' shapes (config.json on the Hub), with num_hidden_layers cut where noted.
LLAMA_32_1B = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
LLAMA_31_8B_4L = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=4,  # of 32
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
QWEN3_8B_4L = dict(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=4,  # of 36
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=True,
)

_DEFAULTS = dict(
    micro=1,
    seq=1024,
    num_micro=2,
    dtype="float32",
    autocast=False,
    ckpt=False,
    chunk=None,
    schedule="1f1b",
    outer="local",
)


def _case(name, model, pp, stage, **options):
    return {"name": name, "model": model, "pp": pp, "stage": stage, **_DEFAULTS, **options}


CASES = [
    # Llama-3.2-1B, whole (16 layers) over 8 stages: a middle stage (2 layers) in every precision
    _case("1b-s1-fp32", LLAMA_32_1B, 8, 1),
    _case("1b-s1-fp32-ckpt", LLAMA_32_1B, 8, 1, ckpt=True),
    _case("1b-s1-autocast", LLAMA_32_1B, 8, 1, autocast=True),
    _case("1b-s1-bf16", LLAMA_32_1B, 8, 1, dtype="bfloat16"),
    _case("1b-s1-bf16-ckpt", LLAMA_32_1B, 8, 1, dtype="bfloat16", ckpt=True),
    _case("1b-s1-bf16-outer", LLAMA_32_1B, 8, 1, dtype="bfloat16", outer="diloco"),
    # 4 layers over 4 stages: activation checkpointing with more layers per stage
    _case("1b-pp4-s1-bf16", LLAMA_32_1B, 4, 1, dtype="bfloat16", seq=2048),
    _case("1b-pp4-s1-bf16-ckpt", LLAMA_32_1B, 4, 1, dtype="bfloat16", seq=2048, ckpt=True),
    # held microbatches: stage 6 of 8 holds 2 of 4 under 1F1B, all 4 under GPipe
    _case("1b-s6-bf16-1f1b", LLAMA_32_1B, 8, 6, dtype="bfloat16", num_micro=4, seq=2048),
    _case("1b-s6-bf16-gpipe", LLAMA_32_1B, 8, 6, dtype="bfloat16", num_micro=4, seq=2048, schedule="gpipe"),
    # zb-h1: a later stage may hold pp (here all 4) microbatches, stage 0's 1F1B count, and each deferred W
    # the gradients at its weights' joints (stage 0's backward is not split: it holds what 1F1B holds)
    _case("1b-s6-bf16-zbh1", LLAMA_32_1B, 8, 6, dtype="bfloat16", num_micro=4, seq=2048, schedule="zb-h1"),
    # the ends: the embeddings, and the tied lm_head copy with the plain and the chunked loss
    _case("1b-s0-bf16-ckpt", LLAMA_32_1B, 8, 0, dtype="bfloat16", ckpt=True, seq=2048),
    _case("1b-s7-bf16-plain-loss", LLAMA_32_1B, 8, 7, dtype="bfloat16", seq=2048),
    _case("1b-s7-bf16-chunked-loss", LLAMA_32_1B, 8, 7, dtype="bfloat16", seq=2048, chunk=256),
    # Llama-3.1-8B (4 of 32 layers over 4 stages): one 218M-parameter layer
    _case("8b-s1-fp32", LLAMA_31_8B_4L, 4, 1),
    _case("8b-s1-fp32-ckpt", LLAMA_31_8B_4L, 4, 1, ckpt=True),
    _case("8b-s1-bf16-seq4096", LLAMA_31_8B_4L, 4, 1, dtype="bfloat16", seq=4096),
    _case("8b-s1-bf16-seq4096-ckpt", LLAMA_31_8B_4L, 4, 1, dtype="bfloat16", seq=4096, ckpt=True),
    # Qwen3-8B (4 of 36 layers over 4 stages): q/k norms, head_dim 128
    _case("qwen3-8b-s1-bf16-outer", QWEN3_8B_4L, 4, 1, dtype="bfloat16", outer="diloco", seq=2048),
    _case("qwen3-8b-s1-bf16-ckpt", QWEN3_8B_4L, 4, 1, dtype="bfloat16", ckpt=True, seq=2048),
]
QUICK_CASES = [
    _case("tiny-s1-fp32", TINY, 2, 1, seq=64, outer="diloco"),
    _case("tiny-s0-bf16-ckpt", TINY, 2, 0, seq=64, dtype="bfloat16", ckpt=True, chunk=32),
]


# The published shapes of the models in the README's table.
LLAMA_32_3B = dict(
    LLAMA_32_1B, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    head_dim=128,
)  # fmt: skip
LLAMA_31_8B = dict(LLAMA_31_8B_4L, num_hidden_layers=32)
LLAMA_31_70B = dict(
    LLAMA_31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64
)
TABLE_MODELS = {"1B": LLAMA_32_1B, "3B": LLAMA_32_3B, "8B": LLAMA_31_8B, "70B": LLAMA_31_70B}
TABLE_GPUS_GB = (24, 40, 80, 141)
TABLE_HEADROOM = 0.9  # of the card's memory: the CUDA context, allocator caching and fragmentation
TABLE_OPTIONS = dict(
    microbatch_size=1,
    seq_len=4096,
    dtype="bfloat16",
    activation_checkpointing=True,
    loss_chunk_tokens=1024,
    nccl=True,  # the communicators' buffers, estimated
)


def fit_table(offload: bool, master_weights: str = "float32") -> dict:
    """For each model and card: the fewest stages whose every stage fits (bf16 weights, float32 masters unless
    ``master_weights="none"``, activation checkpointing, chunked loss, sequences of 4096, microbatch 1 and 2 x
    stages microbatches, NoLoCo with pairs), and that stage's predicted peak."""
    from transformers import AutoConfig

    from hf_noloco.estimate.memory import estimate_peak_memory

    table = {}
    for name, model in TABLE_MODELS.items():
        config = AutoConfig.for_model(**model)
        peaks = {}
        for pp in range(1, config.num_hidden_layers + 1):
            options = dict(TABLE_OPTIONS, offload_outer_state=offload, master_weights=master_weights)
            peaks[pp] = estimate_peak_memory(config, pp, **options).peak
        row = {}
        for gb in TABLE_GPUS_GB:
            fits = [pp for pp, peak in peaks.items() if peak <= gb * 1e9 * TABLE_HEADROOM]
            row[gb] = {"pp": fits[0], "peak": peaks[fits[0]]} if fits else None
        table[name] = row
    return table


def table_markdown(table: dict) -> str:
    lines = ["| model | " + " | ".join(f"{gb} GB" for gb in TABLE_GPUS_GB) + " |"]
    lines.append("|---" * (len(TABLE_GPUS_GB) + 1) + "|")
    for name, row in table.items():
        cells = [f"pp={c['pp']} ({c['peak'] / 1e9:.0f} GB)" if c else "does not fit" for c in row.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- prediction


def predict(case) -> dict:
    from transformers import AutoConfig

    from hf_noloco.estimate.memory import estimate_stage_memory

    config = AutoConfig.for_model(**case["model"])
    estimate = estimate_stage_memory(
        config,
        case["pp"],
        case["stage"],
        microbatch_size=case["micro"],
        seq_len=case["seq"],
        num_microbatches=case["num_micro"],
        dtype=case["dtype"],
        bf16_autocast=case["autocast"],
        activation_checkpointing=case["ckpt"],
        loss_chunk_tokens=case["chunk"],
        schedule=case["schedule"],
        outer_optimizer=case["outer"],
        num_replicas=1,
        master_weights="none",  # the measured stage is built in its dtype and trained as it is
    )
    return {**estimate.as_dict(), "static": estimate.static}


# ------------------------------------------------------------------------------------ measurement (child)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size


class StageRun:
    """One stage of ``case`` as its rank trains it, on ``device``: built from the meta device with random
    weights, fused AdamW, and DiLoCo's outer state and outer step (every second step) for ``outer="diloco"``.
    Also used by benchmarks/gpu_memory_check.py."""

    def __init__(self, case: dict, device: str = "cpu"):
        import torch
        import torch.distributed as dist
        from transformers import AutoConfig

        from hf_noloco.engine.loading import build_stage
        from hf_noloco.engine.mesh import PipelineMesh
        from hf_noloco.launch.local_launch import free_port
        from hf_noloco.outer.optimizer import OuterOptimizer
        from hf_noloco.outer.settings import OuterSettings

        self.case, self.device = case, torch.device(device)
        self.config = AutoConfig.for_model(**case["model"])
        self.dtype = getattr(torch, case["dtype"])
        torch.manual_seed(0)
        self.stage = build_stage(
            self.config, case["stage"], case["pp"], device=self.device, dtype=self.dtype, seed=0,
            attn_implementation="sdpa",
        )  # fmt: skip
        self.stage.train()
        if case["ckpt"]:
            self.stage.activation_checkpointing_enable()
        self.params = list(self.stage.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6, fused=True)
        if case["outer"] != "local":
            if not dist.is_initialized():
                address = f"tcp://127.0.0.1:{free_port()}"
                dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
            mesh = PipelineMesh.build(1, device=self.device)
            settings = OuterSettings(case["outer"], inner_steps=2)
            self.optimizer = OuterOptimizer(self.optimizer, self.params, mesh, settings)
        self.generator = torch.Generator(device=self.device).manual_seed(1)

    def forward_backward(self) -> int:
        """One step's forwards and backwards, in the stage's schedule order; returns the tokens processed."""
        import torch

        from hf_noloco.engine.losses import next_token_losses, target_token_count
        from hf_noloco.engine.schedule import pipeline_order
        from hf_noloco.engine.split_backward import backward_input

        case, stage, g, dev = self.case, self.stage, self.generator, self.device
        micro, seq = case["micro"], case["seq"]
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=case["autocast"])
        held, weights = {}, {}
        # zb-h1 defers a middle or last stage's weight gradients to the "W" of its order (engine/pipeline.py).
        split = case["schedule"] == "zb-h1" and not stage.is_first and not case["ckpt"]
        for op, m in pipeline_order(case["schedule"], case["num_micro"], case["pp"], case["stage"]):
            if op == "W":
                weights.pop(m)()
            elif op == "F":
                ids = torch.randint(0, self.config.vocab_size, (micro, seq), generator=g, device=dev)
                if stage.is_first:
                    x = ids
                else:  # a received activation: a fresh buffer, as the engine's receive allocates
                    x = torch.randn(micro, seq, self.config.hidden_size, generator=g, device=dev)
                    x = x.to(self.dtype).requires_grad_(True)
                with autocast:
                    y = stage(x, logits=False)
                    if stage.is_last:
                        losses = next_token_losses(y, ids, stage.lm_head, case["chunk"])
                        y = losses.sum() / target_token_count(ids)
                held[m] = (x, y)
            else:
                x, y = held.pop(m)
                grad = None
                if not stage.is_last:  # the next stage's gradient
                    grad = torch.randn(y.shape, generator=g, device=dev).to(y.dtype)
                if split:
                    _, weights[m] = backward_input(y, grad, x, stage.parameters())
                else:
                    y.backward(grad)
                del x, y
        return case["num_micro"] * micro * seq

    def step(self, set_to_none: bool = True) -> int:
        """A training step as the trainer runs it: the schedule, clipping by the norm, the optimizer."""
        import torch

        tokens = self.forward_backward()
        from hf_noloco.engine.buffers import squared_norm

        norm = sum(squared_norm(p.grad) for p in self.params).sqrt()  # as the trainer computes it
        scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        for p in self.params:
            p.grad.mul_(scale.to(p.grad.dtype))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        return tokens

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def measure(case) -> dict:
    """Runs in a fresh process (see main): trains the stage three steps and returns the peaks."""
    import torch
    import torch.distributed
    import transformers  # noqa: F401

    import hf_noloco.engine.loading
    import hf_noloco.engine.pipeline
    import hf_noloco.outer.optimizer  # noqa: F401

    torch.set_num_threads(1)
    baseline = _status("VmRSS")
    _reset_peak()
    run = StageRun(case)
    start = time.monotonic()
    run.step(set_to_none=True)  # creates the optimizer state
    run.step(set_to_none=False)  # the outer step (inner_steps=2); the gradients stay allocated, as zeros
    peak = _status("VmHWM") - baseline
    static = _status("VmRSS") - baseline  # weights, gradients, optimizer and outer state
    _reset_peak()
    run.forward_backward()  # a third forward and backward: what comes on top of the static memory
    activations = _status("VmHWM") - baseline - static
    run.close()
    return {
        "peak": peak,
        "static": static,
        "activations": activations,
        "seconds": time.monotonic() - start,
        "baseline_rss": baseline,
    }


# ------------------------------------------------------------------------------------------------- driver


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable")


def run_case(case, predicted: dict) -> dict:
    needed = predicted["peak"] * 1.3 + 2 * GIB
    available = _available()
    record = {"case": case, "predicted": predicted, "available_before": available}
    if available < needed:
        record["skipped"] = f"{available / GIB:.1f} GiB free, {needed / GIB:.1f} GiB needed"
        return record
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        record["error"] = done.stderr[-3000:]
        return record
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    measured = json.loads(line[len("RESULT ") :])
    record["measured"] = measured
    predicted_activations = predicted["activations"] + predicted["backward_extra"]
    record["peak_error"] = predicted["peak"] / measured["peak"] - 1
    record["static_error"] = predicted["static"] / measured["static"] - 1
    record["activations_error"] = predicted_activations / max(measured["activations"], 1) - 1  # tiny: 0
    return record


def _show(record) -> str:
    name = record["case"]["name"]
    if "measured" not in record:
        return f"{name}: {record.get('skipped') or 'FAILED ' + record.get('error', '')[-500:]}"
    m, p = record["measured"], record["predicted"]
    return (
        f"{name}: peak {m['peak'] / GIB:.2f} GiB measured, {p['peak'] / GIB:.2f} predicted "
        f"({record['peak_error']:+.1%}); activations {m['activations'] / GIB:.2f} vs "
        f"{(p['activations'] + p['backward_extra']) / GIB:.2f} ({record['activations_error']:+.1%}); "
        f"{m['seconds']:.0f} s"
    )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", help="case names to run (merged into the existing results)")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--table", action="store_true", help="only print the README's table of what fits")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(json.loads(args.child))), flush=True)
        return
    if args.table:
        for master in ("float32", "none"):
            for offload in (False, True):
                where = "offloaded to the CPU" if offload else "on the GPU"
                print(f"master_weights {master}, outer state {where}:")
                print(table_markdown(fit_table(offload, master)))
        return
    cases = QUICK_CASES if args.quick else CASES
    if args.only:
        cases = [c for c in cases if c["name"] in args.only]
    results = {}
    if args.only and os.path.exists(args.out):
        with open(args.out) as f:
            results = {r["case"]["name"]: r for r in json.load(f)["cases"]}
    # --quick checks the machinery: its cases run at once, a process each (each measures its own peak).
    # Predictions first, in this thread: transformers' lazy imports are not safe to race from threads.
    predictions = [predict(case) for case in cases]
    with ThreadPoolExecutor(len(cases) if args.quick else 1) as pool:
        records = pool.map(run_case, cases, predictions)  # in order; the full run measures one at a time
    for case, record in zip(cases, records):
        results[case["name"]] = record
        print(_show(record), flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        ordered = [results[c["name"]] for c in (QUICK_CASES if args.quick else CASES) if c["name"] in results]
        import torch
        import transformers

        with open(args.out, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "tolerance": TOLERANCE,
                    "cases": ordered,
                },
                f,
                indent=1,
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
