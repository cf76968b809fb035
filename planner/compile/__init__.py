"""The compiled lowering: a plan under torch.compile, measured and re-planned to fit (README.md)."""
