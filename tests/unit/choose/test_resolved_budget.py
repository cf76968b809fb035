"""A request's budget is resolved once per problem into one record (`choose/budget.py` `ResolvedBudget`):
the bytes as asked, the bytes after the device clamp, the inner budget after the safety margin, and the
notes that explain them. Every stage reads it, so these figures are the budget's whole arithmetic.

Hand-made figures (bytes), the device's limit injected: nothing runs a model."""

from __future__ import annotations

import ckpt_planner.choose.budget as budget_module
from ckpt_planner.choose.budget import ResolvedBudget
from ckpt_planner.settings import Budget

FIXED, PEAK = 1_000_000, 3_000_000  # fixed bytes, peak of the step as given


def test_a_fraction_counts_on_the_fixed_bytes_and_the_peak_as_given():
    got = ResolvedBudget.of(Budget(activation_fraction=0.25), FIXED, PEAK, "cpu")
    assert got.asked == got.nbytes == FIXED + 500_000
    assert got.inner == got.nbytes - int(0.02 * 500_000)  # 2 % of the activation part is the margin
    assert got.notes == got.lowered == ()


def test_bytes_and_gb_are_themselves_and_the_margin_is_the_requests():
    assert ResolvedBudget.of(Budget(nbytes=2_000_000, safety_margin=0.1), FIXED, PEAK, "cpu").inner == 1_900_000
    assert ResolvedBudget.of(Budget(gb=0.002), FIXED, PEAK, "cpu").nbytes == 2_000_000


def test_no_budget_holds_a_model_that_checkpoints_itself_to_its_own_peak():
    plain = ResolvedBudget.of(Budget(), FIXED, PEAK, "cpu")
    assert (plain.asked, plain.nbytes, plain.inner, plain.notes) == (None, None, None, ())
    own = ResolvedBudget.of(Budget(), FIXED, PEAK, "cpu", own_checkpointing=True)
    assert own.asked is None and own.nbytes == PEAK and own.inner == PEAK - int(0.02 * (PEAK - FIXED))
    assert len(own.notes) == 1 and "peak of the model as given" in own.notes[0]


def test_the_device_clamp_lowers_the_bytes_held_to_not_the_bytes_asked(monkeypatch):
    limit = 2_000_000
    monkeypatch.setattr(budget_module, "allocator_limit", lambda device: limit)
    got = ResolvedBudget.of(Budget(nbytes=2_500_000), FIXED, PEAK, "cuda")
    assert (got.asked, got.nbytes) == (2_500_000, limit)
    assert got.inner == limit - int(0.02 * (limit - FIXED))
    assert got.notes == got.lowered and len(got.lowered) == 1 and "2.0 MB" in got.lowered[0]
    asked = got.as_asked()  # what the bytes pass judges
    assert (asked.nbytes, asked.inner, asked.notes) == (2_500_000, 2_500_000 - int(0.02 * 1_500_000), ())
    roomy = ResolvedBudget.of(Budget(nbytes=limit), FIXED, PEAK, "cuda")  # at the limit: unchanged
    assert roomy.nbytes == limit and roomy.lowered == ()


def test_the_smallest_budget_named_is_the_least_whose_inner_budget_holds_the_peak():
    record = ResolvedBudget.of(Budget(nbytes=2_000_000, safety_margin=0.02), FIXED, PEAK, "cpu")
    for peak in (FIXED, FIXED + 1, 1_234_567, 2_999_999):
        least = record.smallest(peak)
        at = ResolvedBudget.of(Budget(nbytes=least, safety_margin=0.02), FIXED, PEAK, "cpu")
        below = ResolvedBudget.of(Budget(nbytes=least - 1, safety_margin=0.02), FIXED, PEAK, "cpu")
        assert at.inner >= peak > below.inner
