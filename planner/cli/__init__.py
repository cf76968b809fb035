"""The command line, `ckpt-planner` / `python -m ckpt_planner`, and the file loading only it does (README.md)."""
