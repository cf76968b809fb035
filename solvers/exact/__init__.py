"""Solvers with an optimality guarantee over a named plan space: `dp` (nested plans on a chain of stages),
`ilp` (flat plans, a MILP) and `bruteforce` (the exhaustive reference on tiny problems) (README.md).
Importing a module registers its solvers."""
