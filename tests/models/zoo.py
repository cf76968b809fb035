"""Model zoo for the correctness tests and benchmarks/zoo.py: transformers models from tiny configs
(random weights) plus a hand-written U-Net with long skip connections and BatchNorm.

Each factory returns (model, example_inputs); models are seeded so two calls build the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = ["UNet", "ZOO", "build", "planned_at_half", "run_case", "solver_names"]


def _ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False)
    model = GPT2LMHeadModel(cfg)  # tied embedding / lm_head
    ids = _ids(2, 64, 128)
    return model, {"input_ids": ids, "labels": ids}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64, use_cache=False,
    )
    ids = _ids(2, 64, 128)
    return LlamaForCausalLM(cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=128,
        max_position_embeddings=64, num_labels=3,
    )
    ids = _ids(2, 64, 128)
    mask = torch.ones_like(ids)
    mask[1, 48:] = 0  # padding in the second sequence
    return BertForSequenceClassification(cfg), {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=32, num_heads=2, vocab_size=128,
        use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg), {"input_ids": _ids(2, 24, 128), "labels": _ids(2, 16, 128)}


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=4, num_labels=4,
    )
    return ViTForImageClassification(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}


def swin():
    from transformers import SwinConfig, SwinModel

    cfg = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=4)
    return SwinModel(cfg), {"pixel_values": torch.randn(2, 3, 32, 32)}


def resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2], layer_type="basic", num_labels=4)
    return ResNetForImageClassification(cfg), {"pixel_values": torch.randn(4, 3, 32, 32)}


def convnext():
    from transformers import ConvNextConfig, ConvNextModel

    cfg = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], image_size=32)
    return ConvNextModel(cfg), {"pixel_values": torch.randn(4, 3, 32, 32)}


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=128, num_mel_bins=16, encoder_layers=1, decoder_layers=1, d_model=64, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
        max_target_positions=32, use_cache=False, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1,
        eos_token_id=2,
    )
    return WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(2, 16, 64),  # [B, mel bins, frames]; frames = 2 * max_source_positions
        "labels": _ids(2, 12, 128),
    }


def mixtral(layers: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=layers, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
        vocab_size=128, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, use_cache=False,
    )
    ids = _ids(2, 16, 128)
    return MixtralForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def qwen2_moe(layers: int = 2):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        num_hidden_layers=layers, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
        moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        vocab_size=128, max_position_embeddings=64, use_cache=False,
    )  # every layer sparse: a top-2 router over 4 experts plus a gated shared expert
    ids = _ids(2, 16, 128)
    return Qwen2MoeForCausalLM(cfg), {"input_ids": ids, "labels": ids}


class _ConvBlock(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    """A small U-Net: long skip connections from every encoder level to its decoder level, BatchNorm."""

    def __init__(self, c: int = 8, levels: int = 3, cin: int = 3, cout: int = 2) -> None:
        super().__init__()
        chans = [c * 2**i for i in range(levels)]
        self.down = nn.ModuleList()
        prev = cin
        for ch in chans:
            self.down.append(_ConvBlock(prev, ch))
            prev = ch
        self.mid = _ConvBlock(prev, prev * 2)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        prev = prev * 2
        for ch in reversed(chans):
            self.up.append(nn.ConvTranspose2d(prev, ch, 2, stride=2))
            self.dec.append(_ConvBlock(2 * ch, ch))
            prev = ch
        self.head = nn.Conv2d(prev, cout, 1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # [B, C_i, H_i, W_i], kept until the decoder
            x = self.pool(x)
        x = self.mid(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


def unet():
    return UNet(), (torch.randn(2, 3, 32, 32),)


ZOO: dict[str, Callable[[], tuple[nn.Module, object]]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "swin": swin,
    "resnet": resnet,
    "convnext": convnext,
    "whisper": whisper,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "unet": unet,
}


def build(name: str) -> tuple[nn.Module, object]:
    """The named zoo model (seeded, training mode) and its example inputs."""
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    model.train()
    return model, inputs



def solver_names() -> list[str]:
    """Every registered solver except `none` (the zoo checks plans that checkpoint) and `ilp_offload`: the zoo's
    problems have no copy bandwidth (the CPU), where it is `ilp`'s plan, which the `ilp` cases check (offload
    plans are checked in tests/unit/solvers/test_offload.py and tests/unit/lower/test_offload.py)."""
    import ckpt_planner.solvers as solvers

    return [name for name in solvers.SOLVERS if name not in ("none", "ilp_offload")]


def planned_at_half(model: nn.Module, inputs: object) -> tuple[Any, Any]:
    """(planner, plan): auto's plan at 50 % of the model's activation memory, under whatever autocast the
    caller set, with no autotune race (bytes are what is checked); at the smallest budget auto names where
    50 % is out of its reach."""
    from ckpt_planner.api import Planner
    from ckpt_planner.errors import InfeasibleBudgetError

    planner = Planner(model, inputs)
    planner.autotune = False
    try:
        return planner, planner.plan(solver="auto", activation_budget=0.5)
    except InfeasibleBudgetError as e:
        return planner, planner.plan(solver="auto", budget_bytes=e.smallest_bytes)


def run_case(
    planner: Any,
    model: nn.Module,
    inputs: object,
    solver: str,
    fraction: float,
    *,
    solver_options: dict[str, Any] | None = None,
    cache: dict | None = None,
    plans: list | None = None,
) -> dict[str, Any]:
    """Plan `model` at `fraction` of its activation memory with `solver`, run one step, compare.

    When the budget is infeasible for the solver, the row says so and the plan is made (and
    verified) at the smallest budget the error names; `smallest_feasible` is False when that
    budget is refused too. A solver that refuses the problem's size (brute force) gives a row
    with `skipped` set. `cache` (a dict kept across calls for one model) reuses the measurement
    of a plan with the same regions (spans, nesting and kept ops). `plans`: where given, the plan made is
    appended to it, for a caller that measures it further.
    """
    from ckpt_planner.errors import InfeasibleBudgetError
    from ckpt_planner.verification import verify

    row: dict[str, Any] = {
        "solver": solver, "fraction": fraction, "feasible": True, "smallest_bytes": None,
        "smallest_feasible": None, "skipped": None,
    }
    options = dict(solver_options or {})
    try:
        try:
            plan = planner.plan(solver=solver, activation_budget=fraction, solver_options=options)
        except InfeasibleBudgetError as e:
            row.update(feasible=False, smallest_bytes=e.smallest_bytes, smallest_feasible=False)
            plan = planner.plan(solver=solver, budget_bytes=e.smallest_bytes, solver_options=options)
            row["smallest_feasible"] = True
    except InfeasibleBudgetError as e:
        return {**row, "failed": f"the smallest budget named is infeasible too: {e}"}
    except ValueError as e:  # brute force: the problem is larger than it enumerates
        if "max_nodes" not in str(e):
            raise
        return {**row, "skipped": str(e).splitlines()[0]}
    # A plan is its regions with their nesting and kept ops: two plans with one set of spans but
    # different kept ops are different plans and are measured apart.
    key = tuple((r.start, r.end, r.depth, r.saved_positions) for r in plan.regions)
    if cache is not None and key in cache:
        report = cache[key]
    else:
        report = verify(model, plan, inputs, repeats=1)
        if cache is not None:
            cache[key] = report
    measured = report.measured_peak_bytes
    if plans is not None:
        plans.append(plan)
    # Where the plan is not bitwise equal to the model, tell apart checkpointing from capture: a
    # captured graph (no checkpointing) that itself rounds differently from eager is a capture defect. A model
    # planned in parts has no one graph to run.
    graph = getattr(planner, "capture", None)
    same_as_graph = report.exact or (graph is not None and _same_step(model, plan.module, graph.graph_module, inputs))
    row.update(
        budget_bytes=plan.budget_bytes,
        baseline_bytes=plan.baseline_peak_bytes,
        predicted_bytes=plan.predicted_peak_bytes,
        measured_bytes=measured,
        measured_live_bytes=report.measured_live_peak_bytes,
        baseline_measured_bytes=report.baseline_measured_peak_bytes,
        baseline_measured_live_bytes=report.baseline_measured_live_peak_bytes,
        prediction_error=(plan.predicted_peak_bytes - measured) / max(1, measured),
        within_budget=plan.budget_bytes is None or measured <= plan.budget_bytes,
        outputs_equal=report.outputs_equal,
        grads_equal=report.grads_equal,
        buffers_equal=report.buffers_equal,
        exact=report.exact,
        max_abs_grad_diff=report.max_abs_grad_diff,
        same_as_captured_graph=same_as_graph,
        regions=len(plan.regions),
        notes=list(plan.notes),
    )
    return row


def _same_step(model: nn.Module, a: nn.Module, b: nn.Module, inputs: object) -> bool:
    """One training step of `a` and of `b` (both running `model`'s state) bitwise equal: outputs, grads, buffers."""
    from ckpt_planner.capture.trace import normalize_inputs
    from ckpt_planner.model_state import ModelState
    from ckpt_planner.verification import default_loss
    from torch.utils import _pytree as pytree

    args, kwargs = normalize_inputs(inputs, model)
    results = []
    with ModelState(model).preserved():
        start = [t.detach().clone() for t in model.buffers()]
        for module in (a, b):
            with torch.no_grad():
                for t, v in zip(model.buffers(), start):
                    t.copy_(v)
            for p in model.parameters():
                p.grad = None
            torch.manual_seed(0)
            out = module(*args, **kwargs)  # both in training mode (an exported module refuses .train())
            default_loss(out).backward()
            leaves = [t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            results.append((leaves, grads, [t.detach().clone() for t in model.buffers()]))
        for p in model.parameters():
            p.grad = None
    (o1, g1, b1), (o2, g2, b2) = results
    if len(o1) != len(o2) or any((x is None) != (y is None) for x, y in zip(g1, g2)):
        return False
    pairs = list(zip(o1, o2)) + [(x, y) for x, y in zip(g1, g2) if x is not None] + list(zip(b1, b2))
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in pairs)
