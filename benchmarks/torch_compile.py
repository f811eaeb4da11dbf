"""Does ``torch.compile`` of a pipeline stage pay on CPU? One process, one thread, the same stage eager and
compiled (inductor, each decoder layer compiled on its own, as a stage would), timed in alternating rounds.

A step is the forward and backward of a stage of the last kind (decoder layers, norm, lm_head and the
loss) and one AdamW step. The compile time (the first compiled step) is reported apart; the step-time ratio
is the median over rounds of compiled / eager, each round timing both one after the other.

    python benchmarks/torch_compile.py            # two model sizes, about 10 minutes on 2 busy cores
    python benchmarks/torch_compile.py --quick    # smoke: a tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import LlamaConfig

from hf_noloco.engine.loading import build_stage
from hf_noloco.engine.losses import next_token_losses, target_token_count

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "torch_compile.json")

MODELS = {
    # the throughput benchmark's model, and a wider one where the matrix multiplies dominate more
    "hidden192": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, vocab_size=4096),
    "hidden512": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, vocab_size=8192),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=256),
}


def _stage(name: str):
    spec = MODELS[name]
    config = LlamaConfig(
        **spec,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    stage = build_stage(config, 0, 1, seed=0)
    return stage, config


def _step(stage, optimizer, batch):
    out = stage(batch, logits=False)
    losses = next_token_losses(out, batch, stage.lm_head)
    loss = losses.sum() / target_token_count(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure(name: str, rows: int, seq_len: int, rounds: int) -> dict:
    torch.manual_seed(0)
    eager, config = _stage(name)
    compiled, _ = _stage(name)
    compiled.load_state_dict(eager.state_dict())
    for layer in compiled.model.layers.values():
        layer.compile(backend="inductor")
    batch = torch.randint(0, config.vocab_size, (rows, seq_len))
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
    start = time.perf_counter()
    first_c = _step(compiled, opt_c, batch)
    compile_s = time.perf_counter() - start
    first_e = _step(eager, opt_e, batch)
    _step(compiled, opt_c, batch)  # a second compiled step: any recompilation happens here, untimed
    _step(eager, opt_e, batch)
    ratios, times_e, times_c = [], [], []
    for r in range(rounds):
        order = [(eager, opt_e, times_e), (compiled, opt_c, times_c)]
        if r % 2:
            order.reverse()
        for module, opt, times in order:
            t = time.perf_counter()
            _step(module, opt, batch)
            times.append(time.perf_counter() - t)
        ratios.append(times_c[-1] / times_e[-1])
    return {
        "model": name,
        "spec": MODELS[name],
        "rows": rows,
        "seq_len": seq_len,
        "rounds": rounds,
        "compile_s": compile_s,
        "first_loss_eager": first_e,
        "first_loss_compiled": first_c,
        "eager_step_s_median": statistics.median(times_e),
        "compiled_step_s_median": statistics.median(times_c),
        "compiled_over_eager_median": statistics.median(ratios),
        "compiled_over_eager_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        runs = [measure("tiny", 2, 32, 3)]
    else:
        runs = [measure("hidden192", 8, 256, 12), measure("hidden512", 4, 256, 12)]
    result = {"torch": torch.__version__, "threads": 1, "runs": runs}
    for run in runs:
        eager, compiled = run["eager_step_s_median"] * 1e3, run["compiled_step_s_median"] * 1e3
        print(
            f"{run['model']}: compile {run['compile_s']:.1f} s, eager {eager:.0f} ms/step, "
            f"compiled {compiled:.0f} ms/step, ratio {run['compiled_over_eager_median']:.3f}"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
