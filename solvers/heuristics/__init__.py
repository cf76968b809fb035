"""Heuristic solvers and the plans people write by hand: `none`, `uniform`, `greedy`, `selective`,
`structured` (README.md). Importing a module registers its solvers."""
