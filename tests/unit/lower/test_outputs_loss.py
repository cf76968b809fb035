"""optimize(..., outputs="loss"): the planned module returns the loss alone, so the logits are not kept."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner import optimize
from ckpt_planner.api import Planner
from ckpt_planner.capture.trace import capture
from ckpt_planner.choose.budget import floor_of
from ckpt_planner.errors import InputError
from ckpt_planner.lower.chunk import ChunkedCall, chunk_capture
from ckpt_planner.lower.outputs import loss_only, loss_outputs
from ckpt_planner.profile.profiler import ProfileConfig
from ckpt_planner.settings import Setup
from ckpt_planner.verification import measure_step_peaks

FLOPS = ProfileConfig(flop_times=True)
VOCAB, WIDTH, SEQ = 512, 16, 256


class LogitsLM(nn.Module):
    """Returns {"loss", "logits"} as a transformers LM does (the loss only when given labels); the logits
    [1, SEQ, VOCAB] fp32 dominate the step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.emb(ids)
        h = torch.cumsum(h, dim=1) / 8  # mixes tokens
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(self.norm(h)).float()
        if labels is None:
            return {"logits": logits}
        return {"loss": F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), "logits": logits}


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : SEQ // 4] = -100
    return {"ids": ids, "labels": labels}


def _model() -> LogitsLM:
    torch.manual_seed(0)
    return LogitsLM().train()


def _step(module, model, inputs):
    for p in model.parameters():
        p.grad = None
    loss = module(**inputs)["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _peak(module, model, inputs) -> int:
    params = list(model.parameters())
    peaks, _ = measure_step_peaks(module, (), inputs, params, params, lambda out: out["loss"], torch.device("cpu"))
    for p in params:
        p.grad = None
    return peaks.allocator


def test_setting_is_checked_where_made():
    assert Setup.of().outputs == "all"
    with pytest.raises(InputError, match="outputs"):
        Setup.of(outputs="logits")


def test_loss_only_keeps_the_type_and_sets_the_rest_to_none():
    loss = torch.tensor(1.0)
    assert loss_only({"loss": loss, "logits": torch.ones(2)}) == {"loss": loss, "logits": None}
    assert loss_only(loss) is loss
    with pytest.raises(InputError, match='outputs="loss"'):
        loss_only({"logits": torch.ones(2)})


def test_copy_shares_the_model_and_leaves_it_as_it_was():
    model = _model()
    inputs = _inputs()
    twin = loss_outputs(model, inputs)
    assert isinstance(twin, LogitsLM) and loss_outputs(twin) is twin
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    assert list(twin.state_dict()) == list(model.state_dict())
    assert twin(**inputs)["logits"] is None and model(**inputs)["logits"] is not None


def test_a_model_without_a_loss_is_refused_in_one_line():
    model = _model()
    with pytest.raises(InputError, match='outputs="loss": the model returned no loss') as e:
        optimize(model, {"ids": _inputs()["ids"]}, budget_bytes=10**9, profile_config=FLOPS, outputs="loss")
    assert "\n" not in str(e.value)


def test_exact_plan_below_the_logits_floor_is_bitwise():
    model = _model()
    inputs = _inputs()
    floors = {
        o: floor_of(Planner(model, inputs, profile_config=FLOPS, outputs=o).profiled, "auto", {}, False)[0]
        for o in ("all", "loss")
    }
    # the logits (512 KB) no longer live through the backward
    assert floors["loss"] <= floors["all"] - SEQ * VOCAB * 4
    budget = (floors["loss"] + floors["all"]) // 2  # below any plan that returns the logits
    plan = optimize(model, inputs, budget_bytes=budget, profile_config=FLOPS, outputs="loss")
    out = plan.module(**inputs)
    assert out["logits"] is None and set(out) == {"loss", "logits"}
    assert list(plan.module.state_dict()) == list(model.state_dict())
    ref_loss, ref_grads = _step(model, model, inputs)
    loss, grads = _step(plan.module, model, inputs)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert _peak(plan.module, model, inputs) <= budget


def test_chunked_plan_never_makes_the_logits_whole():
    model = _model()
    inputs = _inputs()
    # the graphs exact=False plans: each captured by export, its token-wise groups chunked
    chunked = {o: chunk_capture(capture(m, inputs, method="export"))[0].graph_module
               for o, m in (("all", model), ("loss", loss_outputs(model, inputs)))}
    calls = {o: [m for m in gm.modules() if isinstance(m, ChunkedCall)] for o, gm in chunked.items()}
    # with the logits an output, the head's group concatenates them; with the loss alone it returns the loss
    assert any(how == "cat" and m.chunks > 1 for m in calls["all"] for how, _ in m.outputs)
    head = [m for m in calls["loss"] if any(how == "loss" for how, _ in m.outputs)]
    assert head and all(how == "loss" for how, _ in head[0].outputs) and head[0].chunks > 1
    peaks = {o: _peak(gm, model, inputs) for o, gm in chunked.items()}
    assert peaks["all"] - peaks["loss"] >= SEQ * VOCAB * 4  # at least the whole logits
    ref_loss, ref_grads = _step(model, model, inputs)
    loss, grads = _step(chunked["loss"], model, inputs)
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_a_saved_loss_only_plan_rebuilds_returning_the_loss_alone(tmp_path):
    """The plan file records outputs="loss": rebuilt on a fresh model, its module returns the loss alone
    (the graph it was made for), steps as the model does, and fits; apply, which cannot drop the logits
    in place, says so in one line."""
    from ckpt_planner.plan import Plan

    model, inputs = _model(), _inputs()
    floor = floor_of(Planner(model, inputs, profile_config=FLOPS, outputs="loss").profiled, "auto", {}, False)[0]
    plan = optimize(model, inputs, budget_bytes=floor + 64_000, profile_config=FLOPS, outputs="loss", autotune=False)
    assert plan.regions, "the test needs a plan that checkpoints"
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    fresh = _model()
    module = loaded.rebuild(fresh, inputs)
    out = module(**inputs)
    assert out["logits"] is None and loaded.spans() == plan.spans()
    ref_loss, ref_grads = _step(fresh, fresh, inputs)
    loss, grads = _step(module, fresh, inputs)
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert _peak(module, fresh, inputs) <= loaded.budget_bytes
    with pytest.raises(InputError, match="outputs='loss'") as info:
        Plan.load(tmp_path / "plan.json").apply(_model(), inputs)
    assert "\n" not in str(info.value)
