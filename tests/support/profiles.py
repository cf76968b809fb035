"""The profile settings tests plan with, one name per meaning (ProfileConfig is frozen: sharing is safe).

* FLOP_TIMES: costs from FLOP counts, one run, no warm-up: deterministic, so a plan does not follow timing
  noise; for any test that checks which plan was chosen.
* FLOP_TIMES_UNSTORED: FLOP costs with the default runs, and the timing store neither read nor written: a
  test that must not see a step time stored by another run.
* TIMED_ONCE: measured times, one run, no warm-up: the quickest real profile, for tests of the measuring
  itself or of figures that do not decide a plan.
"""

from __future__ import annotations

from ckpt_planner import ProfileConfig

FLOP_TIMES = ProfileConfig(warmup=0, repeats=1, flop_times=True)
FLOP_TIMES_UNSTORED = ProfileConfig(flop_times=True, timing_store=False)
TIMED_ONCE = ProfileConfig(warmup=0, repeats=1)
