"""A fault for launches the tests cannot reach inside (``recipes/train.py`` under torchrun): with
``HF_NOLOCO_TEST_KILL=<step>:<local rank>`` in a worker's environment and this folder on ``PYTHONPATH``, that
worker SIGKILLs itself as training step ``<step>`` begins, in the launcher's first attempt only (a restarted
worker trains on). Python imports ``sitecustomize`` at start-up by itself; without the variable this does
nothing, and the launcher's agent (no ``LOCAL_RANK``) is never touched."""

import os

_SPEC = os.environ.get("HF_NOLOCO_TEST_KILL")
if _SPEC and "LOCAL_RANK" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    _step, _local_rank = (int(x) for x in _SPEC.split(":"))
    if int(os.environ["LOCAL_RANK"]) == _local_rank:
        import signal
        import sys

        import hf_noloco.trainer as _trainer_module

        _train_step = _trainer_module.NoLoCoTrainer.training_step

        def _training_step(self, *args, **kwargs):
            if self.state.global_step == _step - 1:
                print(f"sitecustomize: SIGKILL to myself at step {_step}", flush=True)
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return _train_step(self, *args, **kwargs)

        _trainer_module.NoLoCoTrainer.training_step = _training_step
