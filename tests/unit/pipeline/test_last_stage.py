"""The last stage's loss step, measured in a real schedule: a one-stage pipeline (first and last at once)
under Schedule1F1B in one gloo process, its peak on the live-tensor meter against the prediction."""

import pytest
import torch
import torch.distributed as dist
from ckpt_planner import ProfileConfig
from ckpt_planner.pipeline import plan_stage
from ckpt_planner.profile.memory import LiveMemory
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from benchmarks.pipeline import llama_stages, stage_loss

FAST = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs
MICROBATCHES = 4


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_last_stage_counts_each_done_microbatchs_kept_loss(one_process_group):
    # mse_loss(reduction="sum") on CPU returns a scalar on its elementwise buffer's storage: the schedule
    # keeps each microbatch's loss (one output's bytes here) until the step ends, beside the outputs
    stages, batch, target = llama_stages(1, d=16, hidden=32, batch=2 * MICROBATCHES, seq=8, vocab=16)
    micro = batch.shape[0] // MICROBATCHES
    sp = plan_stage(stages[0], (batch[:micro],), schedule=Schedule1F1B, n_microbatches=MICROBATCHES, stage=0,
                    n_stages=1, budget_bytes=1 << 30, loss_fn=stage_loss, target=target[:micro],
                    profile_config=FAST, check_step=False, solver="greedy")
    assert sp.spec.loss_kept_bytes >= sp.spec.output_bytes
    schedule = Schedule1F1B(PipelineStage(sp.module, 0, 1, torch.device("cpu")), MICROBATCHES, loss_fn=stage_loss)
    meter = LiveMemory()
    meter.track(*stages[0].parameters(), batch, target)
    with meter:
        schedule.step(batch, target=target, losses=[])
    predicted = sp.figures.peak_bytes
    assert abs(meter.peak - predicted) <= 0.005 * predicted, (meter.peak, predicted, sp.figures.parts)
