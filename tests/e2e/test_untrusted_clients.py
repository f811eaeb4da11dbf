"""A run only its members can touch, through the documented launch (``python -m hf_noloco.column_launch``).

One run: a ``--store-only`` store on loopback and three one-stage columns (dp = 3 NoLoCo, fault_train's tiny
model), column 2's worker killed in step 5. An attacker who knows the store's address but not the run's
secret, a plain TCPStore client, tries during that run to

(a) propose an empty view (before any loss: every rank would once have adopted it and left with status 0),
(b) join with the documented ``--join`` line (its guess of the secret) and with raw join requests,
(c) forge the heartbeats of the killed rank (replaying its last count, and counts without a MAC),

and, on a port of its own beside the run, (d) binds the port first: a column launched against it and a store
host started on it refuse to start. Besides, a joiner WITH the secret but another recipe (another outer
period) stands by for column 2: it is refused, and no state is sent to it.

The run ends with every live launch's status 0, the export written (the mean of the two live replicas), and
each attempt named in the logs.
"""

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from hf_noloco.launch.local_launch import free_port
from tests.helpers.fault_runs import FAULT_TRAIN
from tests.helpers.paths import ROOT
from tests.helpers.tiny_models import RECIPE_MODEL

SECRET = "untrusted-clients-test-secret-" + "0123456789abcdef" * 2
GUESS = "an-attackers-guess-of-the-secret-" + "f" * 32
COLUMNS, MAX_STEPS, VICTIM = 3, 30, 2
PREFIX = "hf_noloco/0"


class Attacker:
    """A plain client of the run's store (no secret): what anyone who reaches the port can do."""

    def __init__(self, port: int):
        self.port, self.done, self.stop = port, {}, threading.Event()

    def client(self):
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=30))

    def empty_view(self):  # (a)
        won = self.client().compare_set(f"{PREFIX}/live/view/1", "", json.dumps({"live": [], "by": 0}))
        self.done["empty view"] = won.decode()

    def join_requests(self):  # (b), the requests as the code before authentication wrote them
        store = self.client()
        while not self.stop.wait(0.7):
            try:
                store.set(f"{PREFIX}/live/ask/{VICTIM}/0", "1")
            except dist.DistError:  # the run is over: its store is gone
                return
            self.done["join requests"] = self.done.get("join requests", 0) + 1

    def forge_beats(self):  # (c): the killed rank's last record again, and higher counts without a MAC
        store, key = self.client(), f"{PREFIX}/beat/{VICTIM}"
        last, count = store.get(key), 0
        while not self.stop.wait(0.1):
            count += 1
            try:
                store.set(key, last if count % 2 else f"{'0' * 64}.{10_000 + count}".encode())
            except dist.DistError:  # the run is over: its store is gone
                return
            self.done["forged beats"] = count


def test_a_client_without_the_secret_cannot_end_join_stall_or_take_over_the_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    port, squat_port = free_port(), free_port()
    env = dict(os.environ, HF_NOLOCO_RUN_SECRET=SECRET, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(ON_REPLICA_LOSS="continue", MAX_STEPS=str(MAX_STEPS), P2P_TIMEOUT="5", EXPORT="1")
    env.update(PIPELINE_STAGES="1", XDG_CONFIG_HOME=str(tmp_path / "config"))  # (no secret file is read)
    launch = [sys.executable, "-m", "hf_noloco.column_launch", "--columns", str(COLUMNS), "--stages", "1"]
    run = [*launch, "--store", f"127.0.0.1:{port}"]
    squatted = [*launch, "--store", f"127.0.0.1:{squat_port}"]
    logs, procs = {}, {}

    def start(name, command, **extra):
        logs[name] = open(out / f"{name}.txt", "w")  # noqa: SIM115 - closed below
        procs[name] = subprocess.Popen(
            command, env=dict(env, **extra), stdout=logs[name], stderr=subprocess.STDOUT, cwd=tmp_path
        )

    # (d) The attacker binds a port first; a column launched against it, and a store host, refuse it.
    squatter = dist.TCPStore("127.0.0.1", squat_port, is_master=True, wait_for_workers=False)
    # The refused launches run the real command (`recipes/train.py`, one error line and status 2); they stop
    # before anything of the recipe is built.
    recipe = {"model_config": RECIPE_MODEL, "output_dir": str(out / "refused"), "report_to": "none"}
    recipe.update(pipeline_stages=1, outer_optimizer="noloco", on_replica_loss="continue", max_steps=2)
    recipe["p2p_timeout"] = 5  # how long a worker waits for the store's proof: min(p2p_timeout, 60)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    command = [os.path.join(ROOT, "recipes", "train.py"), str(tmp_path / "recipe.yaml")]
    start("squat-column", [*squatted, "--column", "0", *command])
    start("squat-store", [*squatted, "--store-only"])

    started = time.monotonic()
    start("store", [*run, "--store-only", "--linger", "3"])
    attacker = Attacker(port)
    deadline = time.monotonic() + 60
    while "serving" not in (out / "store.txt").read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    attacker.empty_view()  # (a), before any worker started
    threading.Thread(target=attacker.join_requests, daemon=True).start()  # (b), all along
    # (b) The documented --join line, with the attacker's guess of the secret: refused by its own worker,
    # since the store cannot prove the guess. It runs first, while the store surely serves.
    start("attacker-join", [*run, "--column", str(VICTIM), "--join", *command], HF_NOLOCO_RUN_SECRET=GUESS)
    procs["attacker-join"].wait(timeout=240)
    refused_at = time.monotonic() - started
    for column in range(COLUMNS):
        extra = {"FAULT": f"kill-step:5:{VICTIM}"} if column == VICTIM else {}
        start(f"launch-{column}", [*run, "--column", str(column), FAULT_TRAIN, str(out)], **extra)
    # With the secret, another recipe (another outer period): stands by for the column the run will drop.
    start("other-recipe", [*run, "--column", str(VICTIM), "--join", FAULT_TRAIN, str(out)], INNER_STEPS="4")
    try:
        procs["launch-2"].wait(timeout=240)  # the victim is killed in step 5
        killed_at = time.monotonic() - started
        threading.Thread(target=attacker.forge_beats, daemon=True).start()  # (c)
        codes = {name: proc.wait(timeout=240) for name, proc in procs.items()}
    finally:
        attacker.stop.set()
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
            logs[name].close()
    seconds = time.monotonic() - started
    del squatter
    texts = {name: (out / f"{name}.txt").read_text(errors="replace") for name in procs}
    tails = {name: text[-2500:] for name, text in texts.items()}
    print(
        f"the run with its attackers took {seconds:.1f} s (the attacker's --join refused after "
        f"{refused_at:.1f} s, the victim killed at {killed_at:.1f} s); attacks: {attacker.done}"
    )
    assert codes == {
        "squat-column": 2,
        "squat-store": 2,
        "store": 0,
        "launch-0": 0,
        "launch-1": 0,
        "launch-2": 128 + 9,
        "other-recipe": codes["other-recipe"],
        "attacker-join": 2,
    }, tails
    assert codes["other-recipe"] not in (0, None), tails["other-recipe"]

    # The live columns trained to max_steps, then exported the mean of the two live replicas.
    results = {r: torch.load(out / f"result-rank{r}.pt", weights_only=True) for r in (0, 1)}
    for result in results.values():
        assert result["global_step"] == MAX_STEPS and result["live_replicas"] == [0, 1]
        assert result["joins"] == []  # no state was sent to anyone
    exported = load_file(str(out / "export" / "model.safetensors"))
    for name, tensor in results[0]["weights"].items():
        mean = (tensor.float() + results[1]["weights"][name].float()) / 2
        torch.testing.assert_close(exported[name].float(), mean, rtol=0, atol=1e-6, msg=name)

    survivors = texts["launch-0"] + texts["launch-1"]
    ignored = "Ignored a record in the run's store without a valid MAC at "
    # (a) The empty view was stored first, and ignored; the real one replaced it, dropping column 2 only.
    assert attacker.done["empty view"].startswith('{"live": []')
    assert f"{ignored}{PREFIX}/live/view/1" in survivors
    assert "view 1 in effect: live replicas [0, 1]" in texts["launch-0"] and "in effect" in texts["launch-1"]
    # (b) The attacker's --join refused to start on a store that does not prove its guess; its raw
    # requests were ignored by the leader.
    refusal = f"error (rank {VICTIM} of {COLUMNS}): the store at 127.0.0.1:{port} did not prove the run's"
    assert refusal in texts["attacker-join"] and "Traceback" not in texts["attacker-join"]
    assert f"{ignored}{PREFIX}/live/ask/{VICTIM}/0" in texts["launch-0"]
    # (c) The forged heartbeats did not hide the killed rank: it was dropped.
    assert attacker.done["forged beats"] > 0 and f"{ignored}{PREFIX}/beat/{VICTIM}" in survivors
    # (d) The squatted port: the worker refused a store that cannot prove the secret, the host its port.
    refusal = f"error (rank 0 of {COLUMNS}): the store at 127.0.0.1:{squat_port} did not prove the run's"
    assert refusal in texts["squat-column"] and "Traceback" not in texts["squat-column"]
    assert f"cannot host the run's store on 127.0.0.1:{squat_port}" in texts["squat-store"]
    # The joiner of another recipe was refused by the leader, before any state was sent to it.
    assert "refused the join of column 2 stage 0" in texts["launch-0"]
    assert "the run refused this column's join" in texts["other-recipe"]
    # The secret itself appears in no log.
    assert not any(SECRET in text for text in texts.values())
