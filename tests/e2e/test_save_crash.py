"""A saving process killed (SIGKILL) at random points of its saves, 20 times, always leaves an intact
checkpoint that `auto` resumes.

One driver subprocess (its imports paid once) forks, each round, a saver that writes checkpoint after
checkpoint of a one-stage, one-replica run through the real ``write_checkpoint`` (``save_total_limit: 1``, so
every save also rotates the previous one away), and kills it after a random delay: during the writing of the
rank's files, the hashing, the checksum record, the rename over an older copy, the rotation, or between two
saves. Then a forked verifier with a one-process gloo group runs the real ``resolve_resume`` (what
``resume_from_checkpoint: auto`` runs: every file checked against its SHA-256) and loads the weights it
finds, which must be the ones of the step its ``trainer_state.json`` names. The next round's saver continues
from that step.

A process kill leaves the page cache intact, so this does not test the fsyncs (which only a machine that loses
power would): it tests that no order of the save's steps can leave ``output_dir`` without an intact newest
checkpoint, or with a damaged one under a checkpoint's name.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

ROUNDS = 20

DRIVER = textwrap.dedent(
    """
    import json, os, random, signal, sys, time
    import torch
    from safetensors.torch import load_file
    from hf_noloco.engine.mesh import PipelineMesh
    from hf_noloco.io import checkpoint_files as checkpoint

    run_dir, rounds, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    progress = os.path.join(os.path.dirname(run_dir), "progress.json")
    random.seed(seed)
    mesh = PipelineMesh(0, 1, 1, 1, None, None, torch.device("cpu"))
    RECORD = {"pipeline_stages": 1, "num_replicas": 1, "layer_ranges": [[0, 2]], "outer_optimizer": "noloco",
              "adapter": None}

    def note(**what):  # the saver's own record of what it finished and what it is saving
        with open(progress + ".tmp", "w") as f:
            json.dump(what, f)
        os.replace(progress + ".tmp", progress)

    def save(step):
        weights = {"model.layers.0.w": torch.full((256, 1024), float(step))}  # 1 MiB

        def rank_state(folder):
            checkpoint.save_rank_files(folder, mesh, weights, {"step": step}, {"engine": {"step": step}})
            torch.save({"step": step}, os.path.join(folder, "rng_state.pth"))
            return ["rng_state.pth"]

        def shared(folder):
            with open(os.path.join(folder, "trainer_state.json"), "w") as f:
                json.dump({"global_step": step}, f)
            checkpoint.write_mesh_record(folder, RECORD)

        checkpoint.write_checkpoint(
            run_dir, step, mesh, rank_state, shared, timeout=60, save_total_limit=2, barrier=lambda: None
        )

    def saves(steps, completed):
        for step in steps:
            note(completed=completed, saving=step)
            save(step)
            completed = step
        note(completed=completed, saving=None)

    def child(work):
        pid = os.fork()
        if pid == 0:
            try:
                work()
            finally:
                os._exit(0)
        return pid

    def verify(out):
        import torch.distributed as dist
        from hf_noloco.engine.comm import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        found = checkpoint.resolve_resume(run_dir, True, mesh)
        with open(os.path.join(found, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
        weights = load_file(os.path.join(checkpoint.rank_folder(found, mesh), "model.safetensors"))
        matches = bool((weights["model.layers.0.w"] == step).all())
        with open(out, "w") as f:
            json.dump({"found": os.path.basename(found), "step": step, "weights_match": matches}, f)

    os.waitpid(child(lambda: saves([10, 20], None)), 0)  # the run's first checkpoints
    step, results = 20, []
    for index in range(rounds):
        # Each round resumes the newest checkpoint and saves its step again first (a preemption's save, or
        # the same step after a restart: the old copy is replaced); every fourth round rolls back instead,
        # as a resume of the older checkpoint by path does, and saves at a step between the two (a
        # preemption's save at an odd step), below the newest one.
        if index % 4 == 3:
            steps = [step - 5 + 10 * k for k in range(1000)]
        else:
            steps = [step + 10 * k for k in range(1000)]
        saver = child(lambda: saves(steps, step))
        if index % 4 == 3:  # once the rollback's first save is done, inside the next one
            while json.load(open(progress))["completed"] != steps[0]:
                time.sleep(0.001)
            time.sleep(random.uniform(0.0, 0.002))
        else:
            time.sleep(random.uniform(0.0, 0.015) if index % 2 else random.uniform(0.0, 0.4))
        os.kill(saver, signal.SIGKILL)
        os.waitpid(saver, 0)
        left = sorted(os.listdir(run_dir))
        with open(progress) as f:
            saver_said = json.load(f)
        out = os.path.join(os.path.dirname(run_dir), f"verdict-{index}.json")
        _, status = os.waitpid(child(lambda: verify(out)), 0)
        verdict = json.load(open(out)) if os.path.exists(out) else {"error": status}
        results.append(dict(verdict, left=left, saver=saver_said, rollback=index % 4 == 3))
        step = verdict.get("step", step)
    print("RESULTS " + json.dumps(results))
    """
)


def test_a_save_killed_at_random_points_always_leaves_an_intact_checkpoint(tmp_path):
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    (tmp_path / "driver.py").write_text(DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(tmp_path / "driver.py"), str(run_dir), str(ROUNDS), "36"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    results = json.loads(line[len("RESULTS ") :])
    assert len(results) == ROUNDS
    for verdict in results:
        assert "error" not in verdict, (verdict, done.stderr[-3000:])
        assert verdict["weights_match"], verdict  # the weights of the step the checkpoint names
        assert verdict["found"] == f"checkpoint-{verdict['step']}"
        # The newest checkpoint the saver completed, or the one it was saving if its rename came before the
        # kill: never an older one, nor one of the trajectory a rollback left.
        assert verdict["step"] in (verdict["saver"]["completed"], verdict["saver"]["saving"]), verdict
        # Nothing was damaged under a checkpoint's name (a resume would have moved it aside, skipped-...).
        assert not [n for n in verdict["left"] if n.startswith("skipped-")], verdict
    rollbacks = [v for v in results if v["rollback"] and v["step"] % 10 == 5]
    assert rollbacks and all(any(n.startswith("abandoned-") for n in v["left"]) for v in rollbacks)
    # The kills hit saves in progress (a folder being written or removed was left), not only the gaps.
    mid_save = sum(any(n.startswith("tmp-") for n in v["left"]) for v in results)
    first_save = sum(v["saver"]["saving"] == v["saver"]["completed"] for v in results)
    print(
        f"{ROUNDS} kills in {seconds:.1f} s: {mid_save} inside a save, {first_save} while a step was saved "
        "again"
    )
    assert mid_save >= ROUNDS // 4
