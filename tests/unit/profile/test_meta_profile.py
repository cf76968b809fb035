"""A meta-device profile counts the selective policy's figures in its recording run, not in a second forward.

* The cached bytes per node (what decides that a node may be kept) equal a separate forward's; the op
  counts equal them but where autograd saves an op's own output, whose detach a separate forward runs and
  the recording's saved-tensor hook takes instead (one op fewer). On the meta device they price nothing.
* Where the counts price the policy's dispatch (the start of a stage-wise profile on a device), the
  separate forward still counts them.
* Counting that fails leaves the profile as it was, without the figures.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_planner.capture.trace import capture, flatten_for_graph
from ckpt_planner.lower.selective import PolicyCounter, try_policy_costs
from ckpt_planner.model_state import rng_preserved
from ckpt_planner.profile import profiler
from ckpt_planner.profile.record import fake_of, meta_to_cpu

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def meta_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    cap = capture(model, {"input_ids": torch.zeros(2, 32, dtype=torch.long, device="meta")})  # [B, T]
    return cap.graph_module, flatten_for_graph(cap.graph_module, cap.args, cap.kwargs)


def fake_profile(gm, flat, ops_priced: bool):
    with rng_preserved():
        return profiler._profile_fake(gm, flat, profiler.ProfileConfig(meta=True), torch.device("cpu"), ops_priced=ops_priced)


def separate_pass(gm, flat):
    """The policy's figures from a forward of their own, on fake tensors as the profile makes them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    real = dict(list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)))
    memo: dict[int, torch.Tensor] = {}
    profiler._swap_state(gm, {n: fake_of(mode, t, memo) for n, t in real.items()})
    try:
        with rng_preserved(), mode:
            return try_policy_costs(gm, [fake_of(mode, t, memo) if isinstance(t, torch.Tensor) else t for t in flat],
                                    convert=meta_to_cpu)
    finally:
        profiler._swap_state(gm, real)


def test_recording_counts_what_a_separate_forward_counts(meta_llama):
    gm, flat = meta_llama
    cost, (cached, ops) = fake_profile(gm, flat, ops_priced=False)
    ref_cached, ref_ops = separate_pass(gm, flat)
    assert cached == ref_cached and sum(cached.values()) > 0
    assert ops.keys() == ref_ops.keys()
    assert all(ref_ops[name] - ops[name] in (0, 1) for name in ops)
    assert any(ref_ops[name] != ops[name] for name in ops)  # the detach of a saved output: rsqrt, softmax...
    priced, figures = fake_profile(gm, flat, ops_priced=True)
    assert figures == (ref_cached, ref_ops)
    assert (priced.nodes, priced.storages) == (cost.nodes, cost.storages)  # the graph's figures are the same


def test_failed_counting_leaves_the_profile(meta_llama, monkeypatch):
    gm, flat = meta_llama
    cost, _ = fake_profile(gm, flat, ops_priced=False)

    def fail(*args, **kwargs):
        raise RuntimeError("a tensor without storage")

    monkeypatch.setattr(PolicyCounter, "_count", fail)
    again, figures = fake_profile(gm, flat, ops_priced=False)
    assert figures == (None, None)
    assert (again.nodes, again.storages) == (cost.nodes, cost.storages)
