"""DDP and FSDP2 with checkpointing, 2 processes on the gloo backend: gradients equal single-process training.

Each rank trains on its own shard of the batch; the reference, in every rank,
is the original model without checkpointing run on both shards, gradients
averaged. Two SGD steps are taken, so the training loop itself is checked.
"""

import copy
import fcntl
import json
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ckpt_planner import InfeasibleBudgetError, InputError, Plan, PlanMismatchError, ProfileConfig, optimize
from ckpt_planner.distributed import shard_problem

from tests.models.small import LOCAL

FAST = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs: plans do not follow timing noise
WORLD = 2
TIMEOUT_S = 240  # a hang fails the test instead of blocking the run
TOL = {"rtol": 1e-4, "atol": 1e-6}  # allreduce averages in another order: last bits differ


@pytest.fixture
def one_process_group_at_a_time(tmp_path_factory):
    """pytest-xdist runs two tests at once: two of these tests together (four gloo processes on 2 cores) slow
    each rank's clock, and the ranks plan on measured times. A lock in the folder the session's workers
    share (their temporary folders' parent) runs them one at a time."""
    with (tmp_path_factory.getbasetemp().parent / "process_group.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(worker, rendezvous: Path, *args) -> None:
    """Spawn WORLD ranks of worker(rank, init_method, *args); fail on error or after TIMEOUT_S.

    The ranks meet through a file of the test's own (`rendezvous`, which must not exist yet), not a TCP
    port: a port picked free and closed before rank 0 binds it could be taken meanwhile by another test
    (pytest-xdist runs two at once) or another process on the machine."""
    assert not rendezvous.exists()
    init_method = f"file://{rendezvous}"
    ctx = mp.start_processes(worker, args=(init_method, *args), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"distributed workers did not finish within {TIMEOUT_S} s")


def _shards(template: tuple, step: int) -> list[tuple]:
    """The ranks' batches for a step, shaped like `template` (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    return [
        tuple(
            torch.randn(t.shape, generator=g) if t.is_floating_point() else torch.randint(0, 128, t.shape, generator=g)
            for t in template
        )
        for _ in range(WORLD)
    ]


def _loss(out):
    return out if out.dim() == 0 else out.square().mean()


def _reference_grads(model, shards):
    """Gradients of the unsharded, unchekpointed model averaged over the ranks' shards; BN buffers per rank."""
    grads = [torch.zeros_like(p) for p in model.parameters()]
    buffers = []
    start = [b.clone() for b in model.buffers()]
    for rank, shard in enumerate(shards):
        with torch.no_grad():
            for b, v in zip(model.buffers(), start):
                b.copy_(v)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(rank)
        _loss(model(*shard)).backward()
        for g, p in zip(grads, model.parameters()):
            g += p.grad / WORLD
        buffers.append([b.clone() for b in model.buffers()])
    return grads, buffers


def _worker(rank, init_method, jobs):
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
        for name, paths, plan_dict, case in jobs:
            _train_case(rank, name, paths, plan_dict, case)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        raise


def _train_case(rank, name, paths, plan_dict, case):
    from ckpt_planner.lower.apply import checkpoint_modules
    from torch.nn.parallel import DistributedDataParallel as DDP

    kind, static = case
    model, inputs = LOCAL[name]()
    reference = copy.deepcopy(model)
    if kind == "ddp_module":
        plan = Plan.from_dict(plan_dict)
        wrapped = DDP(plan.rebuild(model, inputs), static_graph=static)
    elif kind == "ddp_apply":
        checkpoint_modules(model, paths)
        wrapped = DDP(model, static_graph=static)
    else:  # fsdp_apply: one FSDP unit per block and the root; checkpoints inside the units
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        units = [f"blocks.{i}" for i in range(len(model.blocks))]
        inside = [p for p in paths if not any(u.startswith(p + ".") for u in units)]
        assert inside, paths
        checkpoint_modules(model, inside)
        mesh = init_device_mesh("cpu", (WORLD,))
        for unit in units:
            fully_shard(model.get_submodule(unit), mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    for step in range(2):
        shards = _shards(inputs, step)
        ref_grads, ref_buffers = _reference_grads(reference, shards)
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(rank)  # dropout masks as in the reference's run of this shard
        _loss(wrapped(*shards[rank])).backward()
        params = list(model.parameters())
        assert len(params) == len(ref_grads)
        for (pname, p), g in zip(model.named_parameters(), ref_grads):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, g, **TOL, msg=lambda m, n=f"{name} {case} step {step} {pname}": f"{n}: {m}")
        if step == 0:  # BatchNorm statistics of this rank's shard, updated once
            for (bname, b), v in zip(model.named_buffers(), ref_buffers[rank]):
                assert torch.equal(b, v), (case, bname)
        optimizer.step()
        with torch.no_grad():
            for p, g in zip(reference.parameters(), ref_grads):
                p -= 0.05 * g
    with torch.no_grad():
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            torch.testing.assert_close(full, q, **TOL, msg=lambda m, n=f"{name} {case} {pname}": f"{n}: {m}")


@pytest.mark.slow  # two gloo processes, DDP and FSDP2: ~20 s on 2 busy cores
@pytest.mark.usefixtures("one_process_group_at_a_time")
def test_ddp_and_fsdp2_match_single_process_training(tmp_path):
    """A transformer with dropout and tied weights, and a CNN with BatchNorm; one pair of processes."""
    jobs = []
    for name in ("tiny_gpt", "cnn"):
        model, inputs = LOCAL[name]()
        plan = optimize(model, inputs, activation_budget=0.85, solver="uniform", profile_config=FAST)
        assert plan.regions
        paths = list(plan.apply(copy.deepcopy(model)).modules)
        for case in (("ddp_module", False), ("ddp_apply", True), ("fsdp_apply", False)):
            jobs.append((name, paths, plan.to_dict(), case))
    _run(_worker, tmp_path / "rendezvous", jobs)


def test_sharding_scales_resident_state():
    model, inputs = LOCAL["mlp"]()
    plans = {
        s: optimize(model, inputs, solver="none", optimizer="adam", profile_config=FAST, world_size=4, sharding=s)
        for s in ("ddp", "fsdp")
    }
    single = optimize(model, inputs, solver="none", optimizer="adam", profile_config=FAST)
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # no buffers in this model
    base = single.problem
    assert plans["ddp"].problem.param_bytes == base.param_bytes + params  # DDP's gradient buckets
    assert plans["ddp"].problem.optimizer_bytes == base.optimizer_bytes == 2 * params
    fsdp = plans["fsdp"].problem
    assert fsdp.param_bytes == -(-params // 4)
    assert fsdp.optimizer_bytes == -(-2 * params // 4)
    assert sum(n.param_grad_bytes for n in fsdp.nodes) <= sum(n.param_grad_bytes for n in base.nodes) // 4 + len(fsdp.nodes)
    assert plans["fsdp"].baseline_peak_bytes < single.baseline_peak_bytes < plans["ddp"].baseline_peak_bytes
    assert any("fsdp x4" in n for n in plans["fsdp"].notes)
    # the same activation bytes: only the resident state changed
    assert [s.nbytes for s in fsdp.storages] == [s.nbytes for s in base.storages]


def test_sharding_arguments_are_checked():
    model, inputs = LOCAL["mlp"]()
    with pytest.raises(InputError, match="sharding"):
        optimize(model, inputs, solver="none", world_size=2)
    with pytest.raises(InputError, match="sharding"):
        optimize(model, inputs, solver="none", world_size=2, sharding="zero3")
    with pytest.raises(InputError, match="world_size"):
        optimize(model, inputs, solver="none", world_size=0, sharding="ddp")
    problem = optimize(model, inputs, solver="none", profile_config=FAST).problem
    assert shard_problem(problem, model, world_size=1, sharding=None) == (problem, [])


# -- ranks agree: planning under torch.distributed is collective ---------------------------------------

SLOW_RANK = 1
SLEEP_S = 0.01  # per call of the slowed layers on SLOW_RANK: its clock says they are expensive


def _agree_worker(rank, init_method, solver):
    try:
        _agree(rank, init_method, solver)
    except BaseException:
        traceback.print_exc()
        raise


def _agree(rank, init_method, solver):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.models.examples import MLPChain
    from tests.models.small import mlp

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    model, inputs = mlp()
    fresh = copy.deepcopy(model)
    if rank == SLOW_RANK:  # the first blocks' leaf layers are slow on this rank only (the graph calls them)
        for block in list(model.blocks)[:3]:
            block[0].register_forward_pre_hook(lambda *_: time.sleep(SLEEP_S))
    measured = ProfileConfig(warmup=0, repeats=1, timing_store=False)  # each rank's own clock
    # rank 0's failure is every rank's: an infeasible budget raises the same error on both
    with pytest.raises(InfeasibleBudgetError, match="smallest budget"):
        optimize(model, inputs, budget_bytes=1000, solver=solver, profile_config=FAST)
    with pytest.raises(InputError, match="replan"):
        optimize(model, inputs, activation_budget=0.5, on_larger_shape="replan", profile_config=FAST)
    # a rank whose model is not the one rank 0 planned refuses the plan, and every rank raises
    other = MLPChain(d=64, blocks=5) if rank == SLOW_RANK else model
    with pytest.raises(PlanMismatchError, match=f"rank {SLOW_RANK}"):
        optimize(other, inputs, activation_budget=0.5, solver=solver, profile_config=FAST)
    plan = optimize(model, inputs, activation_budget=0.5, solver=solver, profile_config=measured)
    plans = [None] * WORLD
    dist.all_gather_object(plans, json.dumps(plan.to_dict(), sort_keys=True))
    assert plans[0] == plans[1], f"rank {rank}: the ranks' plans differ"
    assert plan.regions and any("planned on rank 0 of 2" in n for n in plan.notes)
    # DDP over plan.module: one step, gradients averaged over the ranks' shards
    shards = _shards(inputs, 0)
    ddp = DDP(plan.module)
    ddp(*shards[rank]).square().mean().backward()
    grads = [None] * WORLD
    dist.all_gather_object(grads, [p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    # FSDP2 over the same plan applied module by module (the checkpoints inside the one unit)
    plan.apply(fresh)
    sharded = fully_shard(fresh, mesh=init_device_mesh("cpu", (WORLD,)))
    loss = sharded(*shards[rank]).square().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in fresh.parameters())
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # two gloo processes planning: ~40 s on 2 busy cores
@pytest.mark.parametrize("solver", ["auto"])
@pytest.mark.usefixtures("one_process_group_at_a_time")
def test_ranks_agree_on_one_plan_with_a_slow_rank(solver, tmp_path):
    """Rank 1 runs three layers slowly: on its own clock it would plan otherwise. Rank 0 plans and
    broadcasts; both ranks hold the same plan, and a DDP and an FSDP2 step with it complete. Rank 0's
    errors are raised on every rank, and a rank whose model differs makes every rank refuse the plan."""
    _run(_agree_worker, tmp_path / "rendezvous", solver)
