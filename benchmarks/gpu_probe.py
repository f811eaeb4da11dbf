"""One GPU probe: every CUDA/NCCL path of the package that one GPU can exercise, step by step.

    bash benchmarks/gpu_probe.sh               # on one GPU: 8 minutes at most, each step under a timeout
    bash benchmarks/gpu_probe.sh --device cpu  # the dry mode: the same steps on CPU (the test suite runs it)

``gpu_probe.sh`` runs each step of :data:`STEPS` as a process of its own (``python gpu_probe.py step NAME``)
under ``timeout``; a step writes its rows to ``OUT/steps/NAME.json`` as it goes, so a step that hangs or dies
still reports what it found. ``python gpu_probe.py report`` then writes ``OUT/gpu_probe.json`` and a short
table, ``OUT/gpu_probe.txt``. A row is ``check``, ``passed`` (True, False, or None: skipped), ``detail`` and,
where CUDA cannot give the bit-equality the CPU tests assert, the ``tolerance`` used and why.

What one GPU can run: a one-rank NCCL world (a rank may send to itself inside ``batch_isend_irecv``) and every
single-process CUDA path. Several ranks cannot share one GPU under NCCL ("Duplicate GPU detected"), and gloo
cannot move CUDA tensors point to point, so pipelines of several ranks need several GPUs (gpu_check.sh).

The steps, in the order they run (the most informative first):

- ``versions``: torch, CUDA, NCCL, flash-attn, transformers; the package imported from this copy of the tree.
- ``nccl``: a one-rank NCCL world: ``comm.exchange`` of bf16, int64 and uint8 tensors to itself with stream
  waits: behind ``torch.cuda._sleep`` the host returns in under 5 ms and the data is right; an abort from
  another thread unblocks a posted, unmatched receive, and the next call raises the lost-peer error naming
  the rank. (Dry mode: two gloo ranks; gloo's abort does not interrupt a posted receive, so that row skips.)
- ``trainer``: the Trainer on one NCCL rank: bf16 weights through float32 masters, packed rows
  (flash-attention where installed), DiLoCo with ``outer_dtype: int8``, the outer state offloaded, offloaded
  activation checkpointing, under ``torch.cuda.set_sync_debug_mode("warn")``: host syncs per call site per
  step (target: none per microbatch), CUDA-event time against wall time, and the pinning of slow weights,
  momentum and error feedback.
- ``split``: ZB-H1's split backward (B then W) on a stage against two plain backwards (their difference is the
  noise floor), under sdpa, packed flash-attention and compiled layers.
- ``codecs``: int8, float8_e4m3 and int4 on 64M values: error bounds, 20 rounds of error feedback, the GPU's
  packets against the CPU's.
- ``gpu_check``: benchmarks/gpu_check.py's single-process and packed-rows checks.
- ``memory``: benchmarks/gpu_memory_check.py's cases (zb-h1 included), each against the memory model.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, ROOT)  # the package from this copy of the tree, installed or not
sys.path.insert(0, BENCH_DIR)  # its siblings (_probe_report), however it is run

import torch  # noqa: E402
from _probe_report import STEPS, budget, report  # noqa: E402 - benchmarks/_probe_report.py: no torch


class Recorder:
    """A step's rows and data, rewritten to its JSON file after every row (a step killed at its timeout still
    reports what it found)."""

    def __init__(self, path: str):
        self.path, self.rows, self.data = path, [], {}
        self.save()

    def row(self, check: str, passed: bool | None, detail: str, tolerance: str | None = None) -> None:
        self.rows.append(dict(check=check, passed=passed, detail=detail, tolerance=tolerance))
        mark = "SKIP" if passed is None else "PASS" if passed else "FAIL"
        print(f"{mark} {check}: {detail}", flush=True)
        self.save()

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(dict(rows=self.rows, data=self.data), f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)

    @contextlib.contextmanager
    def guarded(self, check: str):
        """A check that raises is a FAIL row naming what it raised; the step goes on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - reported, never fatal to the other checks
            self.row(check, False, f"{type(exc).__name__}: {str(exc)[-800:]}")
            traceback.print_exc()


def _cuda(device: str) -> bool:
    return device == "cuda"


def _synchronize(device: str) -> None:
    if _cuda(device):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------- versions


def step_versions(device: str, rec: Recorder) -> None:
    import transformers

    import hf_noloco

    def version(dist_name: str) -> str | None:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None

    nccl = None
    with contextlib.suppress(Exception):
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    package = os.path.dirname(os.path.abspath(hf_noloco.__file__))
    rec.data.update(
        python=sys.version.split()[0],
        torch=torch.__version__,
        cuda=torch.version.cuda,
        nccl=nccl,
        flash_attn=version("flash-attn") or version("flash_attn"),
        transformers=transformers.__version__,
        accelerate=version("accelerate"),
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        gpus=torch.cuda.device_count(),
        package=package,
        device=device,
    )
    for key in ("torch", "cuda", "nccl", "flash_attn", "transformers", "gpu"):
        print(f"{key}: {rec.data[key]}", flush=True)
    expected = os.path.join(ROOT, "hf_noloco")
    rec.row("the package is imported from this copy of the tree", package == expected, package)
    if _cuda(device):
        rec.row("a CUDA device", torch.cuda.is_available(), str(rec.data["gpu"]))
        rec.row("NCCL available", torch.distributed.is_nccl_available(), f"NCCL {nccl}")


# ----------------------------------------------------------------------------------------------------- nccl


def _world(device: str) -> None:
    """A one-rank process group: NCCL on the GPU, gloo on the CPU."""
    import torch.distributed as dist

    from hf_noloco.engine.comm import free_port

    if not dist.is_initialized():
        if _cuda(device):
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if _cuda(device) else "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0) if _cuda(device) else None,
        )


def _nccl_rank(device: str, numel: int, emit=None) -> list:
    """The exchange and abort checks on this rank (rank 0 of a one-rank NCCL world, or of two gloo ranks
    in the dry mode, where rank 1 is the peer). Each row goes to ``emit`` as it is found (a check that hangs
    leaves the earlier ones); returns them too."""
    import torch.distributed as dist

    from hf_noloco.engine import comm
    from hf_noloco.engine.mesh import PipelineMesh

    rows = _Rows(emit)
    mesh = PipelineMesh.build(1, device=torch.device("cuda", 0) if _cuda(device) else "cpu")
    rank, world = mesh.rank, mesh.world_size
    peer = (rank + 1) % world  # itself in a one-rank world
    dev = mesh.device
    stream = comm.stream_waits_for(mesh.world_group, dev)
    rows.append(
        ("NCCL operations are stream waits", stream if _cuda(device) else None, f"stream waits: {stream}")
    )
    g = torch.Generator(device=dev).manual_seed(rank)
    sent = [
        torch.randn(numel, generator=g, device=dev).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (numel,), generator=g, device=dev, dtype=torch.int64),
        torch.randint(0, 256, (numel,), generator=g, device=dev, dtype=torch.int64).to(torch.uint8),
    ]
    received = [torch.empty_like(t) for t in sent]
    for _ in range(2):  # the first call sets the communicator up; the second is timed
        busy = None
        if _cuda(device):
            torch.cuda._sleep(int(5e8))  # about a quarter of a second of GPU time ahead of the exchange
            busy = torch.cuda.Event()
            busy.record()
        start = time.perf_counter()
        pending = comm.exchange(
            [(t, peer) for t in sent],
            [(t, peer) for t in received],
            60.0,
            mesh.describe_rank,
            "probe",
            group=mesh.world_group,
        )
        comm.wait_sends(pending, 60.0, "probe")
        host_ms = (time.perf_counter() - start) * 1e3
        gpu_still_busy = busy is not None and not busy.query()
        _synchronize(device)
    if _cuda(device):
        rows.append(
            (
                "behind torch.cuda._sleep the host returns from exchange and its waits in under 5 ms",
                host_ms < 5 and gpu_still_busy,
                f"{host_ms:.2f} ms; the GPU was {'still' if gpu_still_busy else 'no longer'} busy",
            )
        )
    if world == 1:
        expected = sent
    else:  # the peer's tensors, made from its own seed
        g = torch.Generator(device=dev).manual_seed(peer)
        expected = [
            torch.randn(numel, generator=g, device=dev).to(torch.bfloat16),
            torch.randint(-(2**40), 2**40, (numel,), generator=g, device=dev, dtype=torch.int64),
            torch.randint(0, 256, (numel,), generator=g, device=dev, dtype=torch.int64).to(torch.uint8),
        ]
    for got, want in zip(received, expected):
        size = f"{got.numel() * got.element_size() / 2**20:.1f} MiB"
        rows.append(
            (f"{str(got.dtype).removeprefix('torch.')} exchanged exactly", torch.equal(got, want), size)
        )

    # An abort from another thread (the heartbeat watcher's) while a receive that nobody matches is posted.
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # the dry mode's peer: silent from here on
        store.wait(["probe/done"])
        return rows
    unmatched = torch.empty(1 << 16, device=dev)
    lost = [peer]
    if _cuda(device):
        check = "an abort from another thread unblocks a posted, unmatched receive"
        try:  # a receive from itself that no send matches: NCCL may refuse it outright, or wait forever
            waiting, _ = comm.post([], [(unmatched, peer)], mesh.describe_rank, mesh.world_group)
            comm.wait_sends(
                waiting, 60.0, "probe"
            )  # a stream wait: the stream waits for a receive never sent
        except Exception as exc:  # noqa: BLE001 - reported; the abort is still checked below
            rows.append((check, None, f"NCCL refused the unmatched receive: {type(exc).__name__}: {exc}"))
            mesh.abort(lost)
        else:
            after = torch.cuda.Event()
            after.record()
            timer = threading.Timer(1.0, mesh.abort, args=(lost,))
            start = time.monotonic()
            timer.start()
            while not after.query() and time.monotonic() - start < 20:
                time.sleep(0.01)
            unblocked = after.query()
            seconds = time.monotonic() - start
            timer.join()
            moved = f"the stream moved on {seconds:.2f} s after the receive (the abort came at 1.0 s)"
            rows.append((check, unblocked, moved if unblocked else "still blocked 20 s later"))
    else:
        mesh.abort(lost)
        rows.append(
            ("an abort unblocks a posted, unmatched receive", None, "gloo's abort does not (NCCL's does)")
        )
    name = mesh.describe_rank(peer)
    try:
        comm.exchange(
            [(sent[0], peer)], [(received[0], peer)], 5.0, mesh.describe_rank, "probe", mesh.world_group
        )
        rows.append(
            ("after the abort, a call raises the lost-peer error naming the rank", False, "nothing raised")
        )
    except Exception as exc:  # noqa: BLE001 - the error is the result
        named = comm.is_lost_peer(exc) and f"Peers that stopped responding: {name}" in str(exc)
        rows.append(
            (
                "after the abort, a call raises the lost-peer error naming the rank",
                named,
                f"{type(exc).__name__}: {exc}",
            )
        )
    registered = dist.is_initialized() and dist.get_world_size() == world
    rows.append(("after the abort every group is still registered", registered, f"world size {world}"))
    store.set("probe/done", "1")
    return rows


class _Rows(list):
    """Rows kept, and handed to ``emit`` as they come."""

    def __init__(self, emit=None):
        super().__init__()
        self.emit = emit

    def append(self, row) -> None:
        super().append(row)
        if self.emit is not None:
            self.emit(*row)


def _nccl_worker(device: str, numel: int) -> list:
    return list(_nccl_rank(device, numel))


def step_nccl(device: str, rec: Recorder) -> None:
    if _cuda(device):
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # as NoLoCoConfig sets it
        _world(device)
        _nccl_rank(device, 8 << 20, emit=rec.row)
    else:
        from hf_noloco.launch.local_launch import run_distributed

        for row in run_distributed(_nccl_worker, 2, device, 1024, timeout_s=60)[0]:
            rec.row(*row)
    os._exit(0)  # an aborted communicator can hang the interpreter's exit


# -------------------------------------------------------------------------------------------------- trainer


def _packed_corpus(rows: int, seq: int, vocab: int):
    """Rows of several documents each (positions restarting at every document; its first label -100), each
    document a learnable run of tokens (t -> t + 1)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for _ in range(rows):
        ids, labels, positions = [], [], []
        while len(ids) < seq:
            n = min(int(torch.randint(seq // 8, seq // 2, (1,), generator=g)), seq - len(ids))
            start = int(torch.randint(0, vocab, (1,), generator=g))
            doc = [(start + i) % vocab for i in range(n)]
            ids += doc
            labels += [-100] + doc[1:]
            positions += list(range(n))
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["position_ids"].append(positions)
    return Dataset.from_dict(out)


class _SyncLog:
    """The host syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports, by step and call site (the first
    frame of this package, transformers or accelerate)."""

    def __init__(self):
        self.step: int | str = "set-up"
        self.counts: Counter = Counter()

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return self._original(message, category, filename, lineno, file, line)
        site = f"{os.path.basename(filename)}:{lineno}"
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = frame.filename.replace(os.sep, "/")
            if any(part in path for part in ("/hf_noloco/", "/transformers/", "/accelerate/")):
                site = "/".join(path.split("/")[-2:]) + f":{frame.lineno}"
                break
        self.counts[self.step, site] += 1
        return None

    @contextlib.contextmanager
    def recording(self, device: str):
        self._original = warnings.showwarning
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self.showwarning
            if _cuda(device):
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                if _cuda(device):
                    torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = self._original


def step_trainer(device: str, rec: Recorder) -> None:
    from transformers import LlamaConfig, TrainerCallback

    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.trainer import NoLoCoTrainer

    cuda = _cuda(device)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from hf_noloco.engine.comm import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    if cuda:
        _world(device)  # one NCCL rank, joined before the config: Accelerate keeps a group already made
    flash = cuda and importlib.util.find_spec("flash_attn") is not None
    impl = "flash_attention_2" if flash else "sdpa"
    hidden, layers, seq, vocab, steps = (512, 4, 1024, 2048, 16) if cuda else (64, 2, 64, 256, 6)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )
    micro, per_step = 2, 8
    out = tempfile.mkdtemp(prefix="gpu_probe_trainer_")
    args = NoLoCoConfig(
        output_dir=out,
        per_device_train_batch_size=per_step,
        microbatch_size=micro,
        learning_rate=3e-3,
        warmup_steps=0,
        lr_scheduler_type="constant",
        max_steps=steps,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not cuda,
        seed=0,
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": impl},
        master_weights="float32",
        outer_optimizer="diloco",
        outer_dtype="int8",
        inner_steps=4 if cuda else 2,
        offload_outer_state=True,
        gradient_checkpointing=True,
        activation_checkpointing_kwargs={"offload": True},
    )
    rec.data.update(
        attention=impl,
        model=dict(hidden=hidden, layers=layers, seq=seq, vocab=vocab),
        microbatches=per_step // micro,
    )
    log = _SyncLog()

    class Steps(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            log.step = state.global_step + 1
            self.wall = time.perf_counter()
            if cuda:
                self.begin = torch.cuda.Event(enable_timing=True)
                self.begin.record()

        def on_step_end(self, args, state, control, **kwargs):
            wall = time.perf_counter() - self.wall  # before any sync of ours
            log.step = "the probe's own timing"  # not the training's: left out of the counts
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                end.synchronize()
                self.times.append((wall * 1e3, self.begin.elapsed_time(end)))
            log.step = "between steps"

    timing = Steps()
    trainer = NoLoCoTrainer(config, args, train_dataset=_packed_corpus(per_step * steps, seq, vocab))
    trainer.add_callback(timing)
    with log.recording(device):
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rec.row("the loss falls", losses[-1] < losses[0], f"{losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps")
    mesh = trainer.mesh
    rec.row(
        "one NCCL rank" if cuda else "one gloo rank",
        mesh.backend == ("nccl" if cuda else "gloo"),
        mesh.backend,
    )
    master = {p.dtype for p in trainer.model.parameters() if p.requires_grad}
    rec.row(
        "bf16 weights trained through float32 masters",
        master == {torch.float32},
        f"trained {sorted(map(str, master))}",
    )
    layout = "one flat row (flash-attention)" if flash else "a block-diagonal mask (sdpa)"
    rec.row(f"packed rows run as {layout}", trainer.model.flattens_packed_rows == flash, impl)
    outer = trainer.outer
    for name, tensors in (
        ("slow weights", outer.outer_state.phi_flat),
        ("momentum", outer.outer_state.delta_flat),
        ("error feedback", outer.wire.error),
    ):
        where = sorted({(t.device.type, t.is_pinned()) for t in tensors})
        rec.row(
            f"offloaded {name} in pinned host memory", where == [("cpu", cuda)], f"(device, pinned): {where}"
        )
    per_step_counts: dict = {}
    for (step, site), n in log.counts.items():
        per_step_counts.setdefault(str(step), {})[site] = n
    rec.data["syncs_by_step"] = per_step_counts
    # Steps 1-2 set up (allocations, lazy initialisations); an outer step ends every inner_steps-th step.
    inner_steps = args.inner_steps
    inner = [s for s in range(3, steps + 1) if s % inner_steps]
    outer_steps = [s for s in range(3, steps + 1) if not s % inner_steps]

    def per_site(step_list):
        sites = {site for (step, site) in log.counts if step in step_list}
        return {site: max(log.counts.get((s, site), 0) for s in step_list) for site in sorted(sites)}

    microbatches = per_step // micro
    inner_sites, outer_sites = per_site(inner), per_site(outer_steps)
    per_microbatch = {site: n for site, n in inner_sites.items() if n >= microbatches}
    rec.data["syncs_per_step"] = dict(inner_steps=inner_sites, outer_steps=outer_sites)
    if cuda:
        suspects = per_microbatch or "none"
        detail = (
            f"{sum(inner_sites.values())} syncs per inner step at most, at {len(inner_sites)} call sites; "
            f"at least once per microbatch ({microbatches} a step): {suspects}"
        )
        rec.row("no host sync per microbatch (set_sync_debug_mode)", not per_microbatch, detail)
        extra = {site: n - inner_sites.get(site, 0) for site, n in outer_sites.items()}
        extra = {site: n for site, n in extra.items() if n > 0}
        rec.row(
            "the host syncs an outer step adds (target: one read per outer step)",
            None,
            f"{sum(extra.values())} more than an inner step: {extra or 'none'}",
        )
        walls = sorted(w for w, _ in timing.times[2:])
        gpus = sorted(g for _, g in timing.times[2:])
        if walls:
            wall, gpu = statistics.median(walls), statistics.median(gpus)
            rec.data["step_ms"] = dict(wall=wall, gpu=gpu)
            rec.row(
                "CUDA-event time against wall time per step (median)",
                True,
                f"wall {wall:.1f} ms, GPU {gpu:.1f} ms ({gpu / wall:.2f} of it)",
            )
    else:
        rec.row("no host sync per microbatch (set_sync_debug_mode)", None, "needs CUDA")
    trainer.end()


# ---------------------------------------------------------------------------------------------------- split


def _split_variant(device: str, variant: str) -> tuple[float, float]:
    """(noise floor, split's difference): the largest gradient difference, relative to the largest gradient,
    of two plain backwards, and of B then W against the first."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_noloco.engine.losses import next_token_losses
    from hf_noloco.engine.partition import split_model
    from hf_noloco.engine.split_backward import backward_input
    from hf_noloco.engine.stage import packed_sequence_lengths

    cuda = _cuda(device)
    hidden, seq, rows = (1024, 2048, 4) if cuda else (64, 32, 2)
    config = LlamaConfig(
        vocab_size=4096 if cuda else 256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128 if hidden >= 128 else 1,
        max_position_embeddings=seq,
    )
    config._attn_implementation = "flash_attention_2" if variant == "packed flash-attention" else "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    stage = split_model(model, 1, 2)  # the last stage: two layers, the norm, the chunked loss
    if variant == "compiled layers":
        backend = "inductor" if cuda else "aot_eager"
        for layer in stage.model.layers.values():
            layer.compile(backend=backend)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, seq, hidden, device=device, generator=g)
    labels = torch.randint(0, config.vocab_size, (rows, seq), device=device, generator=g)
    positions = varlen = None
    if variant == "packed flash-attention":
        positions = (
            torch.cat([torch.arange(n) for n in (seq // 4, seq // 2, seq // 4)]).repeat(rows, 1).to(device)
        )
        varlen = packed_sequence_lengths(positions)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()

    def run(split: bool):
        stage.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        with autocast:
            hidden_states = stage(leaf, position_ids=positions, logits=False, varlen=varlen)
            loss = next_token_losses(hidden_states, labels, stage.lm_head, seq // 2, stage.extras).sum()
        if split:
            grad_input, weights = backward_input(loss, None, leaf, stage.parameters())
            weights()
        else:
            loss.backward()
            grad_input = leaf.grad
        return [grad_input.detach().float()] + [p.grad.detach().float().clone() for p in stage.parameters()]

    def difference(a, b) -> float:
        return max(float((u - v).abs().max() / u.abs().max().clamp(min=1e-30)) for u, v in zip(a, b))

    first, second = run(False), run(False)
    split = run(True)
    _synchronize(device)
    return difference(first, second), difference(first, split)


SPLIT_TOLERANCE = (
    "twice the noise floor of two plain backwards of the same inputs (CUDA's attention backward and "
    "split-K matrix multiplies accumulate with atomics, so two backwards differ); bit-equal when the floor "
    "is 0"
)


def step_split(device: str, rec: Recorder) -> None:
    for variant in ("sdpa", "packed flash-attention", "compiled layers"):
        check = f"split backward (B then W) against a plain backward, {variant}"
        if variant == "packed flash-attention" and not (
            _cuda(device) and importlib.util.find_spec("flash_attn")
        ):
            rec.row(check, None, "needs CUDA and the flash_attn package")
            continue
        with rec.guarded(check):
            noise, diff = _split_variant(device, variant)
            passed = diff <= 2 * noise if noise > 0 else diff == 0.0
            rec.data[variant] = dict(noise_floor=noise, split_difference=diff)
            rec.row(
                check,
                passed,
                f"largest relative difference {diff:.2e}, noise floor {noise:.2e}",
                SPLIT_TOLERANCE,
            )


# --------------------------------------------------------------------------------------------------- codecs


CODEC_TOLERANCE = (
    "each decoded value within half a quantum of its block (float8: half a unit in the last place, or of the "
    "smallest subnormal), times 1 + 1e-6 for float32 rounding; the GPU's and the CPU's decoded values within "
    "one quantum: a value x / scale at a rounding tie may round the other way where CUDA divides by a "
    "reciprocal"
)


def _quantum(fmt: str, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest error a value may get, per value: half a quantum of its block's scale."""
    if fmt == "float8_e4m3":
        y = (values / scale).abs()
        exponent = torch.floor(torch.log2(y.clamp(min=2.0**-6)))
        return 0.5 * torch.pow(2.0, exponent - 3) * scale  # 3 mantissa bits; subnormals spaced 2^-9
    return 0.5 * scale


def step_codecs(device: str, rec: Recorder) -> None:
    from hf_noloco.outer.compression import BLOCK, LEVELS, dequantize, encode_with_feedback_, quantize

    numel = (64 << 20) if _cuda(device) else (64 << 10)
    g = torch.Generator(device=device).manual_seed(0)
    # values over twelve orders of magnitude, block by block: every scale of a real stage's weights
    magnitudes = torch.pow(10.0, torch.empty(numel // BLOCK, 1, device=device).uniform_(-6, 6, generator=g))
    x = (torch.randn(numel // BLOCK, BLOCK, device=device, generator=g) * magnitudes).reshape(-1)
    scale = (x.view(-1, BLOCK).abs().amax(1, keepdim=True) / 1.0).expand(-1, BLOCK)
    rec.data["numel"] = numel
    for fmt in ("int8", "float8_e4m3", "int4"):
        with rec.guarded(f"{fmt}: error bounds"):
            block_scale = scale / LEVELS[fmt]
            decoded = dequantize(quantize(x, fmt), numel, fmt).view(-1, BLOCK)
            error = (decoded - x.view(-1, BLOCK)).abs()
            bound = _quantum(fmt, x.view(-1, BLOCK), block_scale) * (1 + 1e-6)
            worst = float((error / bound).max())
            rec.row(
                f"{fmt}: every value within its bound",
                worst <= 1.0,
                f"worst error / bound {worst:.3f}",
                CODEC_TOLERANCE,
            )
        with rec.guarded(f"{fmt}: 20 rounds of error feedback"):
            error_state = torch.zeros_like(x)
            total = torch.zeros_like(x, dtype=torch.float64)
            for _ in range(20):
                last_input = (x + error_state).view(-1, BLOCK)  # what the round encodes
                total += dequantize(encode_with_feedback_(x, error_state, fmt), numel, fmt).double()
            # sum_t D(packet_t) = 20 x + e_0 - e_T with e_0 = 0: what is owed (e_T) is the last round's error,
            # within half a quantum of that round's own block scale; the mean error is 20 times smaller
            last_scale = (last_input.abs().amax(1, keepdim=True) / LEVELS[fmt]).expand(-1, BLOCK)
            bound = _quantum(fmt, last_input, last_scale).double() * (1 + 1e-6) + 1e-30
            owed = (20 * x.double() - total).view(-1, BLOCK).abs()
            worst = float((owed / bound).max())
            off = (total + error_state.double() - 20 * x.double()).abs().view(-1, BLOCK)
            absmax = last_input.abs().amax(1, keepdim=True).double()  # float32 rounding is relative to it
            identity = float((off / (20 * absmax + 1e-30)).max())
            mean_error = float((owed / 20).max() / (bound.max()))
            rec.data[f"{fmt}_feedback"] = dict(worst_owed_over_bound=worst, identity=identity)
            rec.row(
                f"{fmt}: after 20 rounds of error feedback what is owed is one round's error at most",
                worst <= 1.0 and identity < 1e-5,
                f"worst owed / bound {worst:.3f} (the mean error {mean_error:.3f} of one round's); "
                f"sum identity off by {identity:.1e} of 20 block maxima (float32 rounding)",
                CODEC_TOLERANCE,
            )
        if _cuda(device):
            with rec.guarded(f"{fmt}: GPU against CPU"):
                on_gpu = quantize(x, fmt).cpu()
                on_cpu = quantize(x.cpu(), fmt)
                differ = float((on_gpu != on_cpu).float().mean())
                gap = (dequantize(on_gpu, numel, fmt) - dequantize(on_cpu, numel, fmt)).view(-1, BLOCK).abs()
                quantum = 2 * _quantum(fmt, x.view(-1, BLOCK).cpu(), block_scale.cpu()) * (1 + 1e-6)
                worst = float((gap / quantum).max())
                rec.row(
                    f"{fmt}: GPU and CPU packets decode within one quantum",
                    worst <= 1.0,
                    f"{differ:.2e} of the bytes differ; worst gap / quantum {worst:.3f}",
                    CODEC_TOLERANCE,
                )
    _synchronize(device)


# ------------------------------------------------------------------------------------- the existing checks


def _run_script(args: list[str], seconds: float) -> tuple[int | None, str]:
    try:
        done = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=seconds, env=dict(os.environ)
        )
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        return None, f"timed out after {seconds:.0f} s: {(exc.stdout or '')[-2000:]}"


def step_gpu_check(device: str, rec: Recorder) -> None:
    """gpu_check.py's single-process and packed-rows checks (the dry mode: packed rows only; the CPU run of
    the single-process check, a training run, a resume and an export, is ``gpu_check.py --device cpu``)."""
    out = os.path.join(os.path.dirname(rec.path), "gpu_check.json")
    only = "single,packed" if _cuda(device) else "packed"
    code, log = _run_script(
        [os.path.join(BENCH_DIR, "gpu_check.py"), "--device", device, "--only", only, "--out-json", out],
        budget("gpu_check", device) - 10,
    )
    if not os.path.exists(out):
        rec.row("gpu_check.py single-process and packed-rows checks", False, f"exit {code}: {log[-1500:]}")
        return
    with open(out) as f:
        for row in json.load(f)["checks"]:
            rec.row(f"gpu_check: {row['check']}", row["passed"], row["detail"])


MEMORY_TOLERANCE = (
    "15%: on CPU every prediction was within 6.4% of its measurement; on a GPU the caching allocator's "
    "rounding and cuBLAS/flash workspaces add memory the model does not count"
)


def step_memory(device: str, rec: Recorder) -> None:
    out = os.path.join(os.path.dirname(rec.path), "gpu_memory_check.json")
    args = [os.path.join(BENCH_DIR, "gpu_memory_check.py"), "--device", device, "--out", out, "--steps", "2"]
    code, log = _run_script(args + ([] if _cuda(device) else ["--quick"]), budget("memory", device) - 10)
    if code != 0:
        reached = "timed out" if code is None else f"exit {code}"
        rec.row("gpu_memory_check.py ran every case", False, f"{reached}: {log[-1500:]}")
    if not os.path.exists(out):
        return
    with open(out) as f:
        for case in json.load(f)["checks"]:
            name = f"memory: {case['name']}"
            if "error" in case:
                rec.row(name, False, case["error"])
            elif case.get("peak_allocated") is None:
                rec.row(
                    name, None, f"{case['tokens_per_s']:.0f} tokens/s; no allocator statistics on the CPU"
                )
            else:
                ratio = case["predicted_over_allocated"]
                gib = {k: case[k] / 2**30 for k in ("predicted_peak", "peak_allocated", "peak_reserved")}
                detail = (
                    f"predicted {gib['predicted_peak']:.2f} GiB, allocated {gib['peak_allocated']:.2f} GiB "
                    f"(x{ratio:.2f}), reserved {gib['peak_reserved']:.2f} GiB, "
                    f"{case['tokens_per_s']:.0f} tokens/s"
                )
                rec.row(name, abs(ratio - 1) <= 0.15, detail, MEMORY_TOLERANCE)


# --------------------------------------------------------------------------------------------------- report


STEP_FUNCTIONS = dict(
    versions=step_versions,
    nccl=step_nccl,
    trainer=step_trainer,
    split=step_split,
    codecs=step_codecs,
    gpu_check=step_gpu_check,
    memory=step_memory,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["list", "step", "report"])
    parser.add_argument("name", nargs="?", help="the step (with `step`)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "gpu_probe"))
    args = parser.parse_args(argv)
    if args.action == "list":
        for name, gpu, dry in STEPS:
            print(name, gpu if _cuda(args.device) else dry)
        return 0
    if args.action == "report":
        return report(args.out, args.device)
    os.makedirs(os.path.join(args.out, "steps"), exist_ok=True)
    rec = Recorder(os.path.join(args.out, "steps", f"{args.name}.json"))
    if _cuda(args.device) and not torch.cuda.is_available():
        rec.row(f"step {args.name}", False, "no CUDA device here (--device cpu runs the dry mode)")
        return 1
    with rec.guarded(f"step {args.name}"):
        STEP_FUNCTIONS[args.name](args.device, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
