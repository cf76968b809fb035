"""compile=True on a model whose own code logs (transformers' loss calls `logger.warning_once`): a budget loose
enough for a plan with no regions compiles the captured graph, not the model's code, which fullgraph refuses."""

import logging

import pytest
import torch
import torch.nn as nn
from ckpt_planner import optimize
from ckpt_planner.compile.compiled import CompiledPlanModule

from tests.support.profiles import FLOP_TIMES

from .compiled_checks import assert_trains


@pytest.fixture(autouse=True)
def _dynamo_clean():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Logs(nn.Module):
    """Logs on every call, as transformers' loss does once per process."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logging.getLogger("ckpt_planner.tests.logs").warning("a warning from the model's own code")
        return self.blocks(x)


def test_regions_lowering_with_no_regions_compiles_the_graph_of_a_model_that_logs():
    model, x = Logs(), torch.randn(32, 64, 16)
    # A budget the plain step fits: the eager plan has no regions, so its module was the model itself.
    plan = optimize(model, (x,), activation_budget=1.0, compile=True, lowering="regions", profile_config=FLOP_TIMES)
    assert isinstance(plan.module, CompiledPlanModule) and plan.module.eager is not model
    assert plan.measured_peak_bytes <= plan.budget_bytes
    assert not any("plan.module is the model itself" in n for n in plan.notes)
    assert any("captured graph compiled" in n for n in plan.notes)
    assert_trains(plan.module, model, x)


def test_stock_gpt2_with_labels_plans_compiled_at_a_loose_fraction():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, use_cache=False))
    ids = torch.randint(0, 128, (2, 32))
    plan = optimize(model, {"input_ids": ids, "labels": ids}, activation_budget=0.9, compile=True,
                    lowering="regions", profile_config=FLOP_TIMES)
    assert isinstance(plan.module, CompiledPlanModule)
    assert plan.measured_peak_bytes <= plan.budget_bytes
    out = plan.module(input_ids=ids, labels=ids)
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
