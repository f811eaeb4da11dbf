"""The outer optimizer's settings, as :class:`~hf_noloco.outer.optimizer.OuterOptimizer` receives them.

They are declared here once: :class:`~hf_noloco.NoLoCoConfig` inherits these fields (their ``--help`` texts
are in its docstring, beside the other options), so a setting has one name, type and default in every layer.
:meth:`OuterSettings.of` copies them out of a config (or any object with those attributes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hf_noloco.rules import (
    OUTER_DTYPES,
    OUTER_METHODS,
    OUTER_STEP_METHODS,
    PAPER_DEFAULTS,
    OuterDtype,
    OuterMethod,
    check_choice,
    check_in_range,
    check_positive_int,
)


@dataclass
class OuterSettings:
    """The outer optimizer's settings, resolved and checked (:meth:`resolve`, when made).

    ``None`` hyperparameters become the paper's default for ``outer_optimizer`` (gamma: equal to beta), then
    every value is checked. ``ddp`` and ``local`` have no outer step: their hyperparameters stay ``None``.
    Ranges: ``inner_steps`` >= 1; ``0 < outer_lr <= 2`` and ``0 <= outer_averaging <= 2`` (above 2 a pull
    towards the group mean overshoots by more than the distance it closes, so replicas drift apart);
    ``0 <= outer_momentum < 1`` (heavy-ball momentum of 1 or more never forgets).

    Args:
        outer_optimizer: ``"noloco"``, ``"diloco"``, ``"ddp"`` or ``"local"``.
        inner_steps, outer_lr, outer_momentum, outer_averaging: H, beta, alpha, gamma.
        gossip_group_size: n, replicas averaged together at a noloco outer step (2: pairs).
        outer_dtype: what crosses the network at an outer step: ``"float32"``, ``"bfloat16"`` (a cast), or a
            block-scaled format with error feedback, ``"int8"``, ``"float8_e4m3"``, ``"int4"``
            (:mod:`hf_noloco.outer.compression`). The outer state itself stays float32.
        offload_outer_state: keep the slow weights and the momentum on the CPU.
        routing_seed: shared by every rank; draws the gossip groups. ``None``: 0 (a config resolves it to its
            ``seed`` first).
        outer_overlap_steps: tau, inner steps that run while an outer step's exchange is in flight (0: the
            exchange blocks). In [0, inner_steps]; noloco and diloco only.
    """

    outer_optimizer: OuterMethod = "noloco"
    inner_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_averaging: float | None = None
    gossip_group_size: int = 2
    outer_dtype: OuterDtype = "float32"
    offload_outer_state: bool = False
    routing_seed: int | None = None
    outer_overlap_steps: int = 0

    @classmethod
    def of(cls, config) -> OuterSettings:
        """The settings of ``config``'s same-named attributes (``routing_seed`` ``None``: ``config.seed``)."""
        values = {f.name: getattr(config, f.name) for f in dataclasses.fields(OuterSettings)}
        if values["routing_seed"] is None:
            values["routing_seed"] = getattr(config, "seed", 0)
        return OuterSettings(**values)

    def __post_init__(self):
        self.resolve()

    def resolve(self) -> None:
        """Every ``None`` becomes its default, in place, and every value is checked."""
        if self.routing_seed is None:
            self.routing_seed = 0
        method = self.outer_optimizer
        check_choice("outer_optimizer", method, OUTER_METHODS)
        check_choice("outer_dtype", self.outer_dtype, OUTER_DTYPES)
        tau = self.outer_overlap_steps
        if isinstance(tau, bool) or not isinstance(tau, int):
            raise ValueError(f"outer_overlap_steps must be an integer, got {tau!r}.")
        if not self.has_outer_step:
            if tau:
                raise ValueError(
                    f"outer_overlap_steps={tau} needs an outer step to overlap: it applies to "
                    f"outer_optimizer 'noloco' and 'diloco', not {method!r}."
                )
            return
        if method != "noloco" and self.outer_averaging is not None:
            raise ValueError("outer_averaging (gamma) only applies to outer_optimizer='noloco'.")
        defaults = PAPER_DEFAULTS[method]
        for name, default in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if method == "noloco" and self.outer_averaging is None:
            self.outer_averaging = self.outer_lr
        check_positive_int("inner_steps", self.inner_steps, "H, inner steps per outer step")
        if not 0 <= tau <= self.inner_steps:
            raise ValueError(
                f"outer_overlap_steps (tau) must be in [0, inner_steps={self.inner_steps}]: an outer step's "
                f"exchange must end before the next one starts, got {tau}."
            )
        check_in_range("outer_lr (beta)", self.outer_lr, 0, 2, False, True, "the paper uses 0.7")
        check_in_range(
            "outer_momentum (alpha)",
            self.outer_momentum,
            0,
            1,
            True,
            False,
            f"the paper uses {defaults['outer_momentum']}",
        )
        if method == "noloco":
            check_in_range(
                "outer_averaging (gamma)",
                self.outer_averaging,
                0,
                2,
                True,
                True,
                "the code uses gamma = beta",
            )
            n = self.gossip_group_size
            if isinstance(n, bool) or not isinstance(n, int) or n < 2:
                raise ValueError(
                    "gossip_group_size must be an integer >= 2 (a replica and at least one partner), "
                    f"got {n!r}."
                )

    @property
    def has_outer_step(self) -> bool:
        return self.outer_optimizer in OUTER_STEP_METHODS

    @property
    def sends_slow_weights(self) -> bool:
        """With gamma == beta the slow weights cancel out of the update: only fast weights travel."""
        return self.outer_optimizer == "noloco" and self.outer_averaging != self.outer_lr

    def check_replicas(self, num_replicas: int) -> None:
        """Refuses a mesh this method cannot run on."""
        if self.outer_optimizer != "noloco":
            return
        if num_replicas < 2:
            raise ValueError(
                "outer method 'noloco' needs at least 2 replicas per stage: with a single replica there is "
                "no partner to average with. For a one-replica run (a debug run on one process, say) add "
                "--outer_optimizer local (no sync), or launch more processes."
            )
        if self.gossip_group_size > num_replicas:
            raise ValueError(
                f"gossip_group_size={self.gossip_group_size} is larger than the {num_replicas} replicas per "
                f"stage: use at most {num_replicas}."
            )
