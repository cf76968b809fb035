"""A causal LM trained with its default `use_cache=True` returns a DynamicCache: captured whole.

Before, torch.export refused the cache in the output ("not a known type"), so such models were
planned in eager pieces. The captured module returns a DynamicCache holding the same tensors.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_planner.api import Planner
from ckpt_planner.capture.trace import capture
from ckpt_planner.lower.apply import module_spans
from ckpt_planner.profile.profiler import ProfileConfig

transformers = pytest.importorskip("transformers")
FLOPS = ProfileConfig(warmup=0, repeats=1, flop_times=True)  # deterministic costs


def _bloom():
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=3, n_head=4)
    assert cfg.use_cache  # the default
    ids = torch.randint(0, 256, (2, 16))
    return transformers.BloomForCausalLM(cfg).train(), {"input_ids": ids, "labels": ids}


def _step(module, params, kw):
    for p in params:
        p.grad = None
    torch.manual_seed(1)
    out = module(**kw)
    out.loss.backward()
    return out, [p.grad.clone() for p in params]


def test_cache_output_captured_whole_and_returned_as_eager_does():
    model, kw = _bloom()
    cap = capture(model, kw)
    assert cap.method == "export"
    params = list(model.parameters())
    want, want_grads = _step(model, params, kw)
    got, got_grads = _step(cap.graph_module, params, kw)
    assert torch.equal(want.loss, got.loss) and torch.equal(want.logits, got.logits)
    assert all(torch.equal(a, b) for a, b in zip(want_grads, got_grads))
    cache = got.past_key_values
    assert type(cache) is type(want.past_key_values) is transformers.DynamicCache
    assert len(cache.layers) == len(want.past_key_values.layers) == 3
    for a, b in zip(want.past_key_values.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert b.keys.shape[-2] == 16  # this step's keys once: nothing appended twice


def test_modules_handed_the_cache_are_not_checkpointed_as_eager_code():
    # Recomputed under checkpoint, a layer handed the cache appends its keys again (a cache of 32
    # where the step made 16) and its attention fails; the graph's regions recompute without it.
    model, kw = _bloom()
    planner = Planner(model, kw, profile_config=FLOPS)
    paths = set(module_spans(planner.problem, model).values())
    assert any(p.endswith("mlp") for p in paths)
    assert not any(p.endswith("self_attention") or p.split(".")[-1].isdigit() for p in paths)


def test_cache_output_captured_as_on_meta_runs_on_the_model_device():
    # The cache's first keys are an empty constant export lifts; made on meta, it is put on the device.
    from ckpt_planner.capture.trace import capture_as_on_meta

    model, kw = _bloom()
    cap = capture_as_on_meta(model, kw)
    params = list(model.parameters())
    want, want_grads = _step(model, params, kw)
    got, got_grads = _step(cap.graph_module, params, kw)
    assert torch.equal(want.loss, got.loss)
    assert all(torch.equal(a, b) for a, b in zip(want_grads, got_grads))


def test_llama_layers_handed_the_cache_are_not_checkpointed_as_eager_code():
    # transformers 5 names the argument `cache`: a Llama layer recomputed with it appends its keys again.
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    assert cfg.use_cache
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 128, (2, 16))
    kw = {"input_ids": ids, "labels": ids}
    planner = Planner(model, kw, profile_config=FLOPS)
    assert planner.capture.method == "export"
    paths = set(module_spans(planner.problem, model).values())
    assert any(p.endswith("mlp") for p in paths)
    assert not any(p.endswith("self_attn") or p.split(".")[-1].isdigit() for p in paths)
    params = list(model.parameters())
    want, want_grads = _step(model, params, kw)
    got, got_grads = _step(planner.capture.graph_module, params, kw)
    assert torch.equal(want.loss, got.loss) and all(torch.equal(a, b) for a, b in zip(want_grads, got_grads))
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(want.past_key_values.layers, got.past_key_values.layers))


def test_captured_module_returns_the_graphs_cache_tensors_without_a_copy():
    # Rebuilding the cache with `update` copied every layer's keys and values: 6 x 131,072 B more
    # than eager's step here, held beside the graph's own and never seen by the profile.
    from ckpt_planner.verification import default_loss, measure_step

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=256, hidden_size=64, n_layer=3, n_head=4)
    model = transformers.BloomForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (8, 64))
    kw = {"input_ids": ids, "labels": ids}
    cap = capture(model, kw)
    params = list(model.parameters())
    peaks = []
    for module in (model, cap.graph_module):
        for p in params:
            p.grad = None
        peak, out = measure_step(module, (), kw, params, params, default_loss, torch.device("cpu"))
        peaks.append(peak)
        del out
    assert peaks[1] == peaks[0], peaks
