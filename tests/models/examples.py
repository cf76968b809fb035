"""The CLI's demo models (planner/cli/examples.py), the one place the tests import them from: a test that
needs TinyGPT, MLPChain or ResidualCNN imports it from here, so the demo's models can change without the
tests reaching into the CLI."""

from ckpt_planner.cli.examples import MLPChain, ResidualCNN, TinyGPT, gpt_example

__all__ = ["MLPChain", "ResidualCNN", "TinyGPT", "gpt_example"]
