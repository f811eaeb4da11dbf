"""The weight gradient each stage computes through a compressed stage boundary, against the float32 wire's.

One training step of the convergence study's 1.25M Llama (benchmarks/studies/factorial.yaml: hidden 128, 4
layers, 2048-word vocabulary) at pp 2 on two gloo processes, from the same initial weights and the same batch
(16 random-token rows of 64 tokens), once per boundary format; per stage, the cosine of its whole gradient
(all parameters as one vector) with the float32 wire's, and their relative distance ``|g - g32| / |g32|``.
Stage 1's gradient sees only the rounded activations; stage 0's also the rounded activation gradients.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/boundary_cosine.py   # ~20 s; boundary_cosine.json
"""

from __future__ import annotations

import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "results", "boundary_cosine.json")
MODEL = dict(
    model_type="llama",
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    tie_word_embeddings=False,
)
ROWS, SEQ, MICRO = 16, 64, 4
FORMATS = {  # name -> engine options
    "float32 wire": {},
    "bfloat16": dict(boundary_dtype="bfloat16", boundary_grad_dtype="bfloat16"),
    "int8": dict(boundary_dtype="int8", boundary_grad_dtype="int8"),
    "fp8 (e4m3 / e5m2)": dict(boundary_dtype="float8_e4m3", boundary_grad_dtype="float8_e5m2"),
    "int4": dict(boundary_dtype="int4", boundary_grad_dtype="int4"),
    "int4, stochastic gradients": dict(
        boundary_dtype="int4", boundary_grad_dtype="int4", boundary_grad_stochastic_rounding=True
    ),
    "int4, blocks of 32": dict(boundary_dtype="int4", boundary_grad_dtype="int4", boundary_block_size=32),
    "int4 activations, int8 gradients": dict(boundary_dtype="int4", boundary_grad_dtype="int8"),
}


def _gradients():
    from transformers import AutoConfig

    from hf_noloco.engine.loading import build_stage
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.engine.pipeline import PipelineEngine
    from hf_noloco.engine.routing import Router

    torch.set_num_threads(1)
    mesh = PipelineMesh.build(2)
    values = dict(MODEL)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config._attn_implementation = "sdpa"
    stage = build_stage(config, mesh.stage, 2, seed=0)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (ROWS, SEQ), generator=g)}
    out = {}
    for name, options in FORMATS.items():
        stage.zero_grad(set_to_none=True)
        engine = PipelineEngine(stage, mesh, Router(1, "fixed"), MICRO, **options)
        engine.train_step(batch)
        out[name] = torch.cat([p.grad.flatten() for p in stage.parameters()]).double()
    return mesh.stage, out


def main() -> None:
    from hf_noloco.launch.local_launch import run_distributed

    rows = []
    for stage, grads in sorted(run_distributed(_gradients, 2, timeout_s=120), key=lambda r: r[0]):
        exact = grads["float32 wire"]
        for name, g in grads.items():
            cosine = float(torch.dot(g, exact) / (g.norm() * exact.norm()))
            distance = float((g - exact).norm() / exact.norm())
            rows.append(dict(stage=stage, format=name, cosine=cosine, relative_distance=distance))
            print(f"stage {stage}  {name:<34} cosine {cosine:.6f}  |g - g32| / |g32| {distance:.4f}")
    os.makedirs(os.path.dirname(OUTPUT), exist_ok=True)
    with open(OUTPUT, "w") as f:
        json.dump(
            dict(model=MODEL, rows_per_step=ROWS, seq_len=SEQ, microbatch_size=MICRO, rows=rows), f, indent=1
        )
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
