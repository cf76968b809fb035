"""A relative position bias added to transformers' boolean mask (BEiT): the exported graph's mask is eager's.

Eager BEiT drops the all-True mask of an unpadded batch and passes its bias [1, H, N, N] to SDPA; the exported
graph keeps the mask and adds it (True counts 1.0) into [B, H, N, N]: equal softmax in exact arithmetic, not in
float32, so every gradient differed by ~1e-8 and the plan's check refused the capture.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from ckpt_planner.capture import export_exact
from ckpt_planner.capture.export_exact import eager_attention_mask, eager_bias_plus_mask
from ckpt_planner.capture.trace import capture
from ckpt_planner.verification import default_loss

transformers = pytest.importorskip("transformers")


def _beit():
    cfg = transformers.BeitConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  image_size=32, patch_size=4, num_labels=4, use_relative_position_bias=True)
    torch.manual_seed(0)
    model = transformers.BeitForImageClassification(cfg).train()
    torch.manual_seed(1)
    return model, {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 3])}


def _step(module, model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    out = module(**inputs)
    default_loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return out.logits.detach().clone(), grads


def _captured(model, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, inputs, method="export").graph_module


def _differing(model, gm, inputs) -> list[str]:
    o1, g1 = _step(model, model, inputs)
    o2, g2 = _step(gm, model, inputs)
    return (["logits"] if not torch.equal(o1, o2) else []) + [n for n in g1 if not torch.equal(g1[n], g2[n])]


def test_beit_captured_step_is_eager_bitwise() -> None:
    model, inputs = _beit()
    gm = _captured(model, inputs)
    assert sum(n.target is eager_bias_plus_mask for n in gm.graph.nodes) == 2  # one per layer's bias
    assert _differing(model, gm, inputs) == []


def test_beit_without_the_fix_differs(monkeypatch) -> None:
    model, inputs = _beit()
    monkeypatch.setattr(export_exact, "_bias_plus_mask", lambda mask, sdpa: None)
    gm = _captured(model, inputs)
    assert not any(n.target is eager_bias_plus_mask for n in gm.graph.nodes)
    assert "logits" in _differing(model, gm, inputs)


def test_eager_bias_plus_mask_decision() -> None:
    torch.manual_seed(0)
    bias = torch.randn(1, 2, 4, 4)  # [1, H, Q, K]
    full = torch.ones(3, 1, 4, 4, dtype=torch.bool)  # [B, 1, Q, K]
    padded = full.clone()
    padded[1, :, :, 3] = False
    alone = eager_bias_plus_mask(bias, full, causal=False, bidirectional=True)
    assert alone is bias  # eager drops an all-True mask: SDPA gets the bias itself, [1, H, Q, K]
    kept = eager_bias_plus_mask(bias, padded, causal=False, bidirectional=True)
    assert kept.shape == (3, 2, 4, 4) and torch.equal(kept, bias + padded)  # eager adds a mask it keeps
    assert eager_attention_mask(padded, causal=False, bidirectional=True) is padded
