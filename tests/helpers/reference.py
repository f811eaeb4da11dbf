"""Independent references the tests compare the engine against."""

from hf_noloco.engine.routing import Router


def origin(router: Router, stage: int, step: int, sample: int, replica: int) -> int:
    """The stage-0 replica whose sample sits at ``replica`` of ``stage``: permutations walked backwards."""
    for boundary in reversed(range(stage)):
        replica = router.permutation(boundary, step, sample).index(replica)
    return replica
