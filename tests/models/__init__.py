"""The tests' models: `examples` (the CLI's demo models, imported from one place), `small` (small models for
the unit tests) and `zoo` (transformers models from tiny configs and a U-Net, also read by benchmarks/zoo.py)."""
