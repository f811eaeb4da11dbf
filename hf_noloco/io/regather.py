"""The optimizer state of a stage gathered by parameter name from the saved stages that held its tensors: a
resume onto another stage split (:mod:`hf_noloco.io.reshard` says which saved stages a rank reads).

A torch optimizer's state dict indexes parameters by position (the order of its param groups), and the
outer optimizer's (:class:`~hf_noloco.outer.optimizer.OuterOptimizer`: slow weights ``phi``, momentum
``delta``, an in-flight step's weights) by the order of its parameters. Checkpoints record both orders as
names (``"param_names"``: ``{"inner": [...], "outer": [...]}``), so each of this stage's positions finds its
state in the saved stage that held the tensor, under the saved position of the same name.
"""

from __future__ import annotations

from collections.abc import Callable

NAMES = "param_names"
# The outer entries that hold one tensor per parameter, in "outer" order (OuterOptimizer.state_dict's; an
# empty list: none, e.g. no error feedback without a compressed outer_dtype).
_PER_PARAMETER = ("phi", "delta", "error_feedback")
_COUNTERS = ("inner_step_count", "outer_step_count")  # equal on every rank of a run: checked


def regather_optimizer_state(
    current: dict,
    names: dict,
    sources: dict[int, dict],
    owner: Callable[[str], tuple[int, str]],
) -> dict:
    """The state dict that gives this stage's optimizer the state its tensors had when saved.

    Args:
        current: this optimizer's own state dict (its param groups' positions and hyperparameter keys).
        names: this optimizer's parameter names, ``{"inner": [name of position 0, ...], "outer": [...]}``.
        sources: saved stage -> its saved optimizer state dict, each with its ``"param_names"``.
        owner: this stage's name -> ``(saved stage, saved name)``
            (:func:`~hf_noloco.io.reshard.tensor_owner`).

    The param groups' hyperparameters (learning rate, betas, ...) are the saved ones of the same group
    (the Trainer builds the same groups, with and without weight decay, on every stage); the step counters
    must agree between the saved stages, and do: every rank of a run steps together. The byte counters and
    the divergence estimate, which only feed the logs, are the first saved stage's.
    """
    first = sources[min(sources)]
    saved_groups = first["param_groups"]
    if len(saved_groups) != len(current["param_groups"]):
        raise ValueError(
            f"The saved optimizer has {len(saved_groups)} param groups, this one "
            f"{len(current['param_groups'])}: it was built differently."
        )
    inner_index, group_of, outer_index = {}, {}, {}
    for stage, saved in sources.items():
        inner_index[stage] = {n: i for i, n in enumerate(saved[NAMES]["inner"])}
        group_of[stage] = {i: g for g, group in enumerate(saved["param_groups"]) for i in group["params"]}
        outer_index[stage] = {n: i for i, n in enumerate(saved[NAMES]["outer"])}

    def saved_position(name: str, index: dict, what: str) -> tuple[int, int]:
        stage, saved_name = owner(name)
        if stage not in sources:
            raise ValueError(f"{name} is held by saved stage {stage}, which was not read.")
        if saved_name not in index[stage]:
            raise ValueError(
                f"The {what} state of saved stage {stage} holds no {saved_name} (needed as {name})."
            )
        return stage, index[stage][saved_name]

    state, groups = {}, []
    for g, (group, saved_group) in enumerate(zip(current["param_groups"], saved_groups)):
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": group["params"]})
        for position in group["params"]:
            name = names["inner"][position]
            stage, saved = saved_position(name, inner_index, "optimizer")
            if group_of[stage][saved] != g:
                raise ValueError(
                    f"{name} was in param group {group_of[stage][saved]} of saved stage {stage}, here in {g}."
                )
            if saved in sources[stage]["state"]:  # a parameter that never stepped has no state yet
                state[position] = sources[stage]["state"][saved]
    result = {"state": state, "param_groups": groups}
    if "outer" not in current:
        return result
    outers = {stage: saved["outer"] for stage, saved in sources.items()}
    for key in _COUNTERS:
        values = {outer[key] for outer in outers.values()}
        if len(values) > 1:
            raise ValueError(f"The saved stages disagree on {key}: {sorted(values)}.")
    flights = {stage: outer.get("in_flight") for stage, outer in outers.items()}
    if len({None if f is None else int(f["apply_at"]) for f in flights.values()}) > 1:
        raise ValueError("The saved stages disagree on the outer step in flight.")

    def by_name(pick: Callable[[dict], list]) -> list:
        picked = []
        for name in names["outer"]:
            stage, saved = saved_position(name, outer_index, "outer optimizer")
            picked.append(pick(outers[stage])[saved])
        return picked

    outer = {k: v for k, v in outers[min(outers)].items() if k not in (*_PER_PARAMETER, "in_flight")}
    for key in _PER_PARAMETER:
        if current["outer"].get(key) and all(o.get(key) for o in outers.values()):
            outer[key] = by_name(lambda o, key=key: o[key])
        elif key in current["outer"]:
            outer[key] = []  # saved without (an older run, or a float outer_dtype): the optimizer starts it
    flight = flights[min(flights)]
    if flight is not None:
        outer["in_flight"] = {
            "apply_at": flight["apply_at"],
            "theta": by_name(lambda o: o["in_flight"]["theta"]),
        }
    result["outer"] = outer
    return result
