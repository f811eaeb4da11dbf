import pytest
import torch.distributed as dist

from hf_noloco.engine.mesh import PipelineMesh, mesh_shape
from hf_noloco.launch.local_launch import run_distributed


def test_mesh_shape_rejects_indivisible_world():
    assert mesh_shape(6, 3) == (2, 3)
    with pytest.raises(ValueError, match="not divisible by pipeline_stages=4") as caught:
        mesh_shape(6, 4)
    assert "accelerate launch" not in str(caught.value)
    # A bare `python recipes/train.py` (one process): the error says how to start several.
    with pytest.raises(ValueError, match=r"with a launcher, e\.g\. `accelerate launch --num_processes N"):
        mesh_shape(1, 2)


def _mesh_facts(pp):
    mesh = PipelineMesh.build(pp)
    import torch

    # Each group's members prove membership by summing their global ranks.
    t = torch.tensor([float(mesh.rank)])
    dist.all_reduce(t, group=mesh.replica_group)
    c = torch.tensor([float(mesh.rank)])
    dist.all_reduce(c, group=mesh.column_group)
    return mesh.stage, mesh.replica, mesh.replica_ranks(), mesh.column_ranks(), t.item(), c.item()


def test_mesh_layout_columns_are_consecutive():
    results = run_distributed(_mesh_facts, 6, 3)
    for rank, (stage, replica, replicas, column, replica_sum, column_sum) in enumerate(results):
        assert rank == replica * 3 + stage
        assert column == [replica * 3 + s for s in range(3)]
        assert replicas == [r * 3 + stage for r in range(2)]
        assert replica_sum == sum(replicas) and column_sum == sum(column)
