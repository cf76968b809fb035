"""The measured race autotune runs: its rules, candidates, measuring, timing-store records and cost refit."""
