"""The in-process profile reuse (profile/bytes_pass.py): a profile serves only calls that would measure
the same bytes. Autocast is ambient: the graph symbolic_trace captures is the same under bf16 autocast
and in fp32, so the key must carry it, or an fp32 plan gets the bf16 figures and goes over budget."""

import pytest
import torch
from ckpt_planner import optimize
from ckpt_planner.profile.bytes_pass import PROFILES, ambient_key
from ckpt_planner.profile.profiler import ProfileConfig

MEASURED = ProfileConfig(flop_times=False, repeats=1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                                torch.nn.Linear(256, 64))))


def _plan(model, x):
    return optimize(model, x, activation_budget=0.75, profile_config=MEASURED, autotune=False,
                    check_step=False)


def test_the_key_names_autocast_grad_mode_and_default_dtype():
    plain = ambient_key()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ambient_key() != plain
    with torch.no_grad():
        assert ambient_key() != plain
    was = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert ambient_key() != plain
    finally:
        torch.set_default_dtype(was)
    assert ambient_key() == plain


@pytest.mark.slow  # three measured profiles (about 30 s); the key's own test runs in the default run
def test_an_fp32_plan_after_a_bf16_one_gets_fp32_figures():
    model, x = _model(), torch.randn(512, 64)
    PROFILES.clear()
    fresh = _plan(model, x)
    PROFILES.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _plan(model, x)
    after = _plan(model, x)
    assert cast.baseline_peak_bytes < fresh.baseline_peak_bytes  # bf16 activations: the two differ
    assert (after.baseline_peak_bytes, after.budget_bytes) == (fresh.baseline_peak_bytes, fresh.budget_bytes)
