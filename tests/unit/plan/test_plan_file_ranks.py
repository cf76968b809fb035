"""A plan loaded from a file under a process group is checked as in one process: every rank checks its
graph and figures, rank 0 checks one training step against the model's own, and every rank learns every
verdict, so no rank runs a plan one refused (2 processes, gloo)."""

from __future__ import annotations

import json
import traceback

import pytest
import torch.distributed as dist

from tests.integration.test_distributed import WORLD, _run, one_process_group_at_a_time  # noqa: F401 - a fixture
from tests.unit.plan.test_plan_file import save_mlp_plan


def _worker(rank, init_method, path, case):
    try:
        _check(rank, init_method, path, case)
    except BaseException:
        traceback.print_exc()
        raise


def _check(rank, init_method, path, case):
    import pytest
    from ckpt_planner import Plan, PlanMismatchError, verification
    from ckpt_planner.cli.examples import MLPChain
    from ckpt_planner.lower.apply import checkpointed_modules

    from tests.models.small import LOCAL

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    model, inputs = LOCAL["mlp"]()
    if case == "step":  # rank 0's step differs from the model's own (rank 1 runs no step: it cannot tell)
        verification.step_differences = lambda *a, **k: ["blocks.0.0.weight"] if rank == 0 else []
        said = r"differs from the model's own" if rank == 0 else r"rank 0: PlanMismatchError: .*differs from the model's"
    else:  # rank 1 holds another model: its graph refuses the plan, and rank 0 learns it
        if rank == 1:
            model = MLPChain(d=64, blocks=5)
        said = r"fingerprint" if rank == 1 else r"rank 1: PlanMismatchError: plan fingerprint"
    with pytest.raises(PlanMismatchError, match=said):
        Plan.load(path).rebuild(model, inputs)
    with pytest.raises(PlanMismatchError, match=said):
        Plan.load(path).apply(model, inputs)
    assert checkpointed_modules(model) == ()
    if case == "step":  # an honest step: both ranks run it
        verification.step_differences = lambda *a, **k: []
        plan = Plan.load(path)
        plan.rebuild(model, inputs)
        assert plan.module is not None
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_group_at_a_time")
@pytest.mark.parametrize("case", ["step", "graph"])
def test_a_loaded_plan_refused_on_one_rank_is_refused_on_every_rank(tmp_path, tmp_path_factory, case):
    _, _, path = save_mlp_plan(tmp_path_factory)
    assert json.loads(path.read_text())["regions"]
    _run(_worker, tmp_path / "rendezvous", str(path), case)
