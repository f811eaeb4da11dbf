"""The rules of a resume onto another mesh, in one process: which saved replica each new replica takes,
which saved stage holds each tensor, which files each rank reads, and the optimizer state gathered by name."""

import itertools

import pytest
import torch

from hf_noloco.io import regather, reshard
from hf_noloco.io.reshard import OPTIMIZER, PIPELINE, WEIGHTS, SavedMesh


def _saved(stages, replicas, ranges, live=None) -> SavedMesh:
    record = {"pipeline_stages": stages, "num_replicas": replicas, "layer_ranges": ranges}
    if live is not None:
        record["live_replicas"] = live
    return SavedMesh.of(record)


@pytest.mark.parametrize(
    "held, replicas, expected",
    [
        ([0, 1, 2, 3], 2, [(0, True), (1, True)]),  # fewer: the first ones continue
        ([0, 1], 4, [(0, True), (1, True), (0, False), (1, False)]),  # more: r copies r % old
        ([0, 1], 3, [(0, True), (1, True), (0, False)]),
        ([1, 3], 2, [(1, True), (3, True)]),  # the live ones, renumbered
        ([0, 1, 3], 4, [(0, True), (1, True), (0, False), (3, True)]),  # back onto the full mesh
        ([1, 3], 4, [(1, False), (1, True), (3, False), (3, True)]),
        ([0, 5], 3, [(0, True), (5, True), (0, False)]),  # beyond the new count: continued first
        ([2], 1, [(2, True)]),
    ],
)
def test_replica_sources(held, replicas, expected):
    assert reshard.replica_sources(held, replicas) == expected


def test_replica_sources_keep_every_saved_replica_they_can_and_continue_each_once():
    for old in range(1, 6):
        for held in itertools.chain.from_iterable(
            itertools.combinations(range(old), k) for k in range(1, old + 1)
        ):
            for replicas in range(1, 8):
                sources = reshard.replica_sources(held, replicas)
                assert len(sources) == replicas and {q for q, _ in sources} <= set(held)
                continued = [q for q, c in sources if c]
                assert len(continued) == len(set(continued)) == min(replicas, len(held))
                if replicas >= len(held):
                    assert set(continued) == set(held)
                for r, (q, c) in enumerate(sources):  # a saved replica that fits keeps its index
                    if replicas > len(held) and q < replicas and c:
                        assert q == r
    with pytest.raises(ValueError, match="holds no replica"):
        reshard.replica_sources([], 2)


def test_tensor_owner_by_name():
    ranges = [(0, 2), (2, 3), (3, 4)]
    assert reshard.tensor_owner("model.embed_tokens.weight", ranges) == (0, "model.embed_tokens.weight")
    assert reshard.tensor_owner("model.layers.1.mlp.up_proj.weight", ranges)[0] == 0
    assert reshard.tensor_owner("model.layers.2.self_attn.q_proj.weight", ranges)[0] == 1
    lora = "model.layers.3.self_attn.q_proj.lora_A.default.weight"  # adapters live in their layer
    assert reshard.tensor_owner(lora, ranges) == (2, lora)
    assert reshard.tensor_owner("model.norm.weight", ranges) == (2, "model.norm.weight")
    assert reshard.tensor_owner("lm_head.weight", ranges, tied=True) == (2, "lm_head.weight")
    # One stage stored a tied matrix once, as the embeddings; untied, lm_head is a tensor of its own.
    assert reshard.tensor_owner("lm_head.weight", [(0, 4)], tied=True) == (0, "model.embed_tokens.weight")
    assert reshard.tensor_owner("lm_head.weight", [(0, 4)], tied=False) == (0, "lm_head.weight")
    with pytest.raises(ValueError, match="layer 7 is in none"):
        reshard.tensor_owner("model.layers.7.mlp.up_proj.weight", ranges)
    with pytest.raises(ValueError, match="No rule says which saved stage holds 'model.vision.x'"):
        reshard.tensor_owner("model.vision.x", ranges)


def test_read_plans():
    two = _saved(2, 2, [[0, 3], [3, 6]])
    three = [(0, 2), (2, 4), (4, 6)]
    # pp2 -> pp3: each new stage reads the saved stages that overlap it, the last the saved last stage.
    plans = [reshard.read_plan(two, s, 1, 3, 2, three) for s in range(3)]
    assert [p.stages for p in plans] == [(0,), (0, 1), (1,)]
    assert not any(p.as_saved for p in plans) and all(p.replica == 1 and p.carries_stream for p in plans)
    assert plans[1].files() == [
        (0, 1, WEIGHTS),
        (0, 1, OPTIMIZER),
        (1, 1, WEIGHTS),
        (1, 1, OPTIMIZER),
        (0, 1, PIPELINE),
    ]
    # pp2 -> pp1: both saved stages.
    assert reshard.read_plan(two, 0, 0, 1, 2, [(0, 6)]).stages == (0, 1)
    # The same layers and ends: the saved folder loads as written, even on a mesh of another size.
    same = reshard.read_plan(two, 1, 3, 2, 4, [(0, 3), (3, 6)])
    assert (same.stages, same.as_saved, same.replica, same.continues, same.carries_stream) == (
        (1,),
        True,
        1,
        False,
        False,
    )
    first_of_three = reshard.read_plan(_saved(3, 1, three), 0, 0, 2, 1, [(0, 2), (2, 6)])
    assert first_of_three.as_saved and first_of_three.stages == (0,)
    # Only the mesh known: the saved split when the stage count is the same, else every saved stage.
    assert reshard.read_plan(two, 1, 0, 2, 2).stages == (1,)
    assert reshard.read_plan(two, 0, 0, 3, 2).stages == (0, 1)
    # More replicas: data shards change, no stream position carries; a replica that continues keeps it.
    assert not reshard.read_plan(two, 0, 0, 2, 4).carries_stream
    live = _saved(2, 4, [[0, 3], [3, 6]], live=[0, 1, 3])
    assert [reshard.read_plan(live, 0, r, 2, 4).carries_stream for r in range(4)] == [True, True, False, True]
    assert [reshard.read_plan(live, 0, r, 2, 3).replica for r in range(3)] == [0, 1, 3]


def _reads(saved, stages, replicas, ranges):
    return {
        f
        for s in range(stages)
        for r in range(replicas)
        for f in reshard.read_plan(saved, s, r, stages, replicas, ranges).files()
    }


@pytest.mark.parametrize("live", [None, [1, 2]])
def test_the_ranks_that_know_only_the_mesh_together_name_every_file_any_rank_reads(live):
    """What the resume's shared verification relies on: checked without the new split, the files of all
    ranks together cover what each rank reads under whatever split it then has."""
    saved = _saved(2, 3, [[0, 2], [2, 6]], live=live)
    for stages, replicas in itertools.product([1, 2, 3], [1, 2, 3, 4]):
        checked = _reads(saved, stages, replicas, None)
        for cuts in itertools.combinations(range(1, 6), stages - 1):
            bounds = [0, *cuts, 6]
            ranges = list(zip(bounds, bounds[1:]))
            assert _reads(saved, stages, replicas, ranges) <= checked, (stages, replicas, ranges)


def test_describe_change():
    saved = _saved(2, 2, [[0, 2], [2, 4]])
    assert reshard.describe_change(saved, 2, 2, [(0, 2), (2, 4)]) is None
    assert saved.same_as(2, 2, None) and not saved.same_as(2, 2, [(0, 3), (3, 4)])
    line = reshard.describe_change(saved, 1, 4, [(0, 4)])
    assert line.startswith(
        "2 stages x 2 replicas (layers [[0, 2], [2, 4]]) -> 1 stage x 4 replicas (layers [[0, 4]])"
    )
    assert "replica 2 copies saved replica 0, 3 copies 1" in line and "gathered by name" in line
    live = reshard.describe_change(_saved(1, 4, [[0, 4]], live=[0, 2, 3]), 1, 2, [(0, 4)])
    assert (
        "live replicas [0, 2, 3]" in live
        and "replica 1 continues saved replica 2" in live
        and "saved replica 3 dropped" in live
    )


def _stage_optimizer(params: dict[str, torch.nn.Parameter], steps: int, seed: int) -> torch.optim.AdamW:
    """AdamW over ``params`` grouped as the Trainer groups them (with and without weight decay), after
    ``steps`` steps on seeded gradients."""
    decay = [p for n, p in params.items() if "norm" not in n]
    rest = [p for n, p in params.items() if "norm" in n]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return optimizer


def _names(optimizer, params):
    name_of = {id(p): n for n, p in params.items()}
    return {
        "inner": [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]],
        "outer": list(params),
    }


def test_the_optimizer_state_is_gathered_by_name():
    """Two saved stages (embeddings + layer 0, layer 1 + norm + lm_head) into one: every tensor's AdamW state
    and its slow weights and momentum are the saved ones of the same name; lr and betas the saved groups'."""
    shapes = {
        "model.embed_tokens.weight": (5, 3),
        "model.layers.0.q.weight": (3, 3),
        "model.layers.0.norm.weight": (3,),
        "model.layers.1.q.weight": (3, 3),
        "model.layers.1.norm.weight": (3,),
        "model.norm.weight": (3,),
        "lm_head.weight": (5, 3),
    }
    names = list(shapes)
    cuts = [names[:3], names[3:]]
    sources, saved_params = {}, {}
    for stage, stage_names in enumerate(cuts):
        params = {n: torch.nn.Parameter(torch.randn(shapes[n])) for n in stage_names}
        optimizer = _stage_optimizer(params, steps=2 + stage, seed=stage)  # distinct states per stage
        state = optimizer.state_dict()
        state["outer"] = {
            "method": "noloco",
            "inner_step_count": 4,
            "outer_step_count": 2,
            "bytes_sent": 10 + stage,
            "phi": [torch.full(shapes[n], float(i + 10 * stage)) for i, n in enumerate(stage_names)],
            "delta": [torch.full(shapes[n], -float(i + 10 * stage)) for i, n in enumerate(stage_names)],
            "error_feedback": [torch.full((2, *shapes[n]), i - 0.5) for i, n in enumerate(stage_names)],
            # an overlapped outer step in flight: the weights it sent, per parameter
            "in_flight": {
                "apply_at": 5,
                "theta": [torch.full(shapes[n], i + 0.5) for i, n in enumerate(stage_names)],
            },
        }
        state[regather.NAMES] = _names(optimizer, params)
        sources[stage] = state
        saved_params.update({n: (stage, i) for i, n in enumerate(stage_names)})
    # The new stage, its parameters in model order (another order of positions than the saved stages').
    params = {n: torch.nn.Parameter(torch.zeros(shapes[n])) for n in names}
    fresh = _stage_optimizer(params, steps=0, seed=9)
    current = fresh.state_dict()
    current["outer"] = {
        "phi": [torch.zeros(shapes[n]) for n in names],
        "delta": [torch.zeros(shapes[n]) for n in names],
        "error_feedback": [torch.zeros((2, *shapes[n])) for n in names],
    }
    owner = lambda name: reshard.tensor_owner(name, [(0, 1), (1, 2)])
    gathered = regather.regather_optimizer_state(current, _names(fresh, params), sources, owner)
    outer = gathered.pop("outer")
    fresh.load_state_dict(gathered)
    for name, p in params.items():
        stage, i = saved_params[name]
        position = sources[stage][regather.NAMES]["inner"].index(name)
        for key, value in sources[stage]["state"][position].items():
            assert torch.equal(fresh.state[p][key], value), (name, key)
        assert torch.equal(outer["phi"][names.index(name)], sources[stage]["outer"]["phi"][i])
        for key in ("delta", "error_feedback"):
            assert torch.equal(outer[key][names.index(name)], sources[stage]["outer"][key][i]), key
        assert torch.equal(
            outer["in_flight"]["theta"][names.index(name)], sources[stage]["outer"]["in_flight"]["theta"][i]
        )
    assert outer["in_flight"]["apply_at"] == 5
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.1, 0.0]
    assert (outer["inner_step_count"], outer["outer_step_count"], outer["bytes_sent"]) == (4, 2, 10)
    # Saved without error feedback (an older run, a float outer_dtype): none is handed on.
    for source in sources.values():
        source["outer"]["error_feedback"] = []
    assert (
        regather.regather_optimizer_state(current, _names(fresh, params), sources, owner)["outer"][
            "error_feedback"
        ]
        == []
    )
    # Saved stages that disagree on the steps taken are not one run's.
    sources[1]["outer"]["inner_step_count"] = 5
    with pytest.raises(ValueError, match="disagree on inner_step_count"):
        regather.regather_optimizer_state(current, _names(fresh, params), sources, owner)
