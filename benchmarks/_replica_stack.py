"""Many replicas of one small model trained in one process: the engine of ``replica_scale_quality.py``.

Every replica of every arm of one (seed, replica count) is a slice of stacked parameters: each parameter is
one leaf tensor of shape ``(slices, *shape)``, slice ``a * R + r`` being replica ``r`` of arm ``a``. A step is
one forward of all slices at once, ``torch.func.vmap`` over ``functional_call`` of the package's own stage
(``hf_noloco.engine.loading.build_stage``, the factorial's model and initialisation), and one backward of the
sum of the slices' losses (each slice's loss depends on its own parameters only, so each slice gets its own
gradient). vmap, rather than a model rewritten with a replica dimension, keeps the model the package's and
transformers' own code.

What is the package's, called as is, on each arm's stacked slices:

- the initial weights (``build_stage``, seeded by the run's seed), the loss (``engine.losses``: token
  cross-entropy divided by the replica batch's target tokens, as the pipeline weights it), the clipping
  (``components.column_stats.clip_gradients_``, by each replica's own norm);
- the inner optimizer: the Trainer's own class and arguments for the factorial's ``NoLoCoConfig``
  (``Trainer.get_optimizer_cls_and_kwargs``: fused AdamW; weight decay on ``get_decay_parameter_names``), made
  once over the stacked tensors. AdamW is elementwise with one step count and one learning rate, so each
  slice gets exactly its own replica's AdamW update; the learning rate is transformers' ``get_scheduler``;
- the outer step: ``outer.gossip.gossip_groups`` (the draws, by the run's seed and the outer-step count),
  ``group_mean_`` and ``noloco_update_`` for NoLoCo, ``diloco_update_`` on the mean pseudo-gradient for
  DiLoCo, nothing for ``local``; then ``theta <- phi``, as ``OuterState.write_back`` does;
- the data: each replica's rows are those Accelerate's ``prepare_data_loader`` gives replica ``r`` of ``R``
  with the Trainer's seedable sampler (``replica_rows``; a test checks it against the loaders themselves).
"""

from __future__ import annotations

import math
import tempfile

import torch
from torch.func import functional_call, vmap

from hf_noloco.components.column_stats import clip_gradients_
from hf_noloco.engine.losses import next_token_losses, target_token_count
from hf_noloco.outer.gossip import diloco_update_, gossip_groups, group_mean_, noloco_update_


def replica_rows(num_rows: int, replicas: int, per_replica: int, data_seed: int, steps: int) -> torch.Tensor:
    """The dataset rows of each replica's batch at each step, ``(steps, replicas, per_replica)``.

    Accelerate's seedable sampler permutes the rows with a generator seeded ``data_seed + epoch``; the batches
    of ``per_replica`` rows are dealt to the replicas in turn (batch ``k`` to replica ``k % replicas``). An
    epoch ends after its last whole global batch (the factorial never reaches the end of its epoch; a longer
    run starts the next permutation there)."""
    global_batch = replicas * per_replica
    per_epoch = num_rows // global_batch
    if per_epoch < 1:
        raise ValueError(f"{num_rows} rows hold no global batch of {global_batch}")
    out, epoch = [], 0
    while len(out) < steps:
        generator = torch.Generator()
        generator.manual_seed(data_seed + epoch)
        perm = torch.randperm(num_rows, generator=generator)
        out += [
            perm[k * global_batch : (k + 1) * global_batch].view(replicas, per_replica)
            for k in range(per_epoch)
        ]
        epoch += 1
    return torch.stack(out[:steps])


def inner_optimizer_setup(lr: float, weight_decay: float, stage) -> tuple[type, dict, set[str]]:
    """The Trainer's inner optimizer for the factorial's config: its class, its arguments, and the names of
    the parameters that get weight decay."""
    from transformers import Trainer

    from hf_noloco.config import NoLoCoConfig

    with tempfile.TemporaryDirectory() as out:
        args = NoLoCoConfig(
            output_dir=out,
            learning_rate=lr,
            weight_decay=weight_decay,
            outer_optimizer="local",
            report_to="none",
        )
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return cls, dict(kwargs), set(Trainer.get_decay_parameter_names(None, stage))


class ReplicaStack:
    """``len(arms)`` arms of ``replicas`` replicas each, from one initialisation, on one data order.

    Args:
        stage: the model (a ``PipelineStage`` of the whole model: ``pp = 1``), initialised; every slice starts
            from its weights. Its own parameters are not trained.
        arms: normalized arms (``_study.normalize_arm``): ``method`` and ``H``, ``alpha``, ``beta``,
            ``gamma``, ``group``.
        replicas: R, replicas per arm.
        seed: the run's seed (the gossip draws; the config's ``routing_seed`` is its ``seed``).
        lr, weight_decay, warmup_steps, max_steps, max_grad_norm: the inner optimizer's schedule.
    """

    def __init__(
        self,
        stage,
        arms: list[dict],
        replicas: int,
        seed: int,
        lr: float,
        weight_decay: float,
        warmup_steps: int,
        max_steps: int,
        max_grad_norm: float = 1.0,
    ):
        from transformers import get_scheduler

        self.stage, self.arms, self.R, self.seed = stage, arms, replicas, seed
        self.max_grad_norm = max_grad_norm
        n = len(arms) * replicas
        self.names = [name for name, _ in stage.named_parameters()]
        self.params = {
            name: p.detach().unsqueeze(0).repeat(n, *[1] * p.dim()).requires_grad_(True)
            for name, p in stage.named_parameters()
        }
        cls, kwargs, decay = inner_optimizer_setup(lr, weight_decay, stage)
        groups = [
            {"params": [self.params[k] for k in self.names if k in decay], "weight_decay": weight_decay},
            {"params": [self.params[k] for k in self.names if k not in decay], "weight_decay": 0.0},
        ]
        self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        self.scheduler = get_scheduler(
            "cosine_with_min_lr",
            self.optimizer,
            num_warmup_steps=warmup_steps,
            num_training_steps=max_steps,
            scheduler_specific_kwargs={"min_lr_rate": 0.1},
        )
        # The outer state of the arms that have one: phi (the slow weights) and delta (the momentum), per
        # parameter, (R, *shape) each; phi = the weights now, delta = 0 (OuterState.build).
        self.phi, self.delta, self.outer_steps = {}, {}, [0] * len(arms)
        for a, arm in enumerate(arms):
            if arm["method"] in ("noloco", "diloco"):
                self.phi[a] = {k: self.view(k, a).detach().clone() for k in self.names}
                self.delta[a] = {k: torch.zeros_like(v) for k, v in self.phi[a].items()}
            elif arm["method"] != "local":
                raise ValueError(f"the replica stack runs noloco, diloco and local, not {arm['method']!r}")
        self.step_count = 0
        self.loss_fn = vmap(self._loss)

    def view(self, name: str, arm: int) -> torch.Tensor:
        """Arm ``arm``'s replicas of parameter ``name``: ``(R, *shape)``, a view of the stacked tensor."""
        return self.params[name].data[arm * self.R : (arm + 1) * self.R]

    def _loss(self, params: dict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = functional_call(
            self.stage, params, (ids,)
        )  # lm_head and the family's logit arithmetic inside
        return next_token_losses(logits, labels).sum() / target_token_count(labels)

    def train_step(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One step of every replica of every arm on ``ids``/``labels`` ``(R, per_replica, block)`` (replica
        ``r``'s batch, the same in every arm); returns the slices' losses."""
        n, arms = len(self.arms) * self.R, len(self.arms)
        losses = self.loss_fn(self.params, ids.repeat(arms, 1, 1), labels.repeat(arms, 1, 1))
        losses.sum().backward()
        with torch.no_grad():
            grads = [self.params[k].grad for k in self.names]
            norm = torch.stack([g.pow(2).flatten(1).sum(1) for g in grads]).sum(0).sqrt()  # per slice
            for k, g in zip(self.names, grads):
                clip_gradients_([self.params[k]], norm.view(n, *[1] * (g.dim() - 1)), self.max_grad_norm)
        self.optimizer.step()
        self.step_count += 1
        for a, arm in enumerate(self.arms):
            if arm["method"] in ("noloco", "diloco") and self.step_count % arm["H"] == 0:
                self.outer_step(a)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses.detach()

    @torch.no_grad()
    def outer_step(self, a: int) -> None:
        """Arm ``a``'s outer step on every one of its replicas, then theta <- phi."""
        arm, R = self.arms[a], self.R
        if arm["method"] == "noloco":
            peers = self.partners(arm["group"], self.outer_steps[a])
        for k in self.names:
            theta, phi, delta = self.view(k, a), self.phi[a][k], self.delta[a][k]
            if arm["method"] == "noloco":
                # NoLoCoExchange._combine_bucket: mean_G theta = theta + (1/n) sum_j (theta_j - theta)
                diffs = [theta[column] - theta for column in peers]
                theta_mean = group_mean_(theta.clone(), diffs)
                phi_mean = None
                if arm["gamma"] != arm["beta"]:  # the partners' slow weights travel too
                    phi_mean = phi.clone()
                    for column in peers:
                        phi_mean += phi[column]
                    phi_mean /= len(peers) + 1
                noloco_update_(phi, delta, theta_mean, arm["alpha"], arm["beta"], arm["gamma"], phi_mean)
            else:  # DiLoCoAllReduce: the all-reduced sum of theta - phi, divided by n
                mean = (theta - phi).sum(0, keepdim=True).div_(R)
                diloco_update_(phi, delta, mean, arm["alpha"], arm["beta"])
            theta.copy_(phi)
        self.outer_steps[a] += 1

    def partners(self, group_size: int, outer_step: int) -> list[torch.Tensor]:
        """Each replica's partners in this outer step's gossip groups, in the group's (sorted) order: one
        index tensor ``(R,)`` per partner position (every group of one size: R a multiple of the size)."""
        if self.R % group_size:
            raise ValueError(
                f"the replica stack needs whole groups: {self.R} replicas, groups of {group_size}"
            )
        groups = gossip_groups(self.R, group_size, self.seed, outer_step)
        table = torch.empty(self.R, group_size - 1, dtype=torch.long)
        for group in groups:
            for r in group:
                table[r] = torch.tensor([j for j in group if j != r])
        return list(table.t())

    @torch.no_grad()
    def eval_totals(
        self, ids: torch.Tensor, labels: torch.Tensor, slices: list[int], chunk_rows: int = 16
    ) -> torch.Tensor:
        """``(summed token cross-entropy, target tokens)`` per slice of ``slices``, each on its own rows
        ``ids``/``labels`` ``(len(slices), m, block)``, float64, ``chunk_rows`` rows per slice at a time."""
        index = torch.tensor(slices)
        params = {k: v.detach()[index] for k, v in self.params.items()}

        def totals(p, x, y):
            losses = next_token_losses(functional_call(self.stage, p, (x,)), y)
            return torch.stack([losses.sum().double(), target_token_count(y).double()])

        fn = vmap(totals)
        out = torch.zeros(len(slices), 2, dtype=torch.float64)
        for start in range(0, ids.shape[1], chunk_rows):
            end = start + chunk_rows
            out += fn(params, ids[:, start:end], labels[:, start:end])
        return out

    @torch.no_grad()
    def divergence(self, a: int) -> float:
        """The package's replica divergence of arm ``a``: sqrt(mean over weights of the population variance
        over its replicas)."""
        total, numel = 0.0, 0
        for k in self.names:
            v = self.view(k, a).double()
            total += v.var(0, unbiased=False).sum().item()
            numel += v[0].numel()
        return math.sqrt(total / numel)
