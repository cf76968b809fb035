"""Helpers for tests that run the CLI in-process: its exit code, and its one line on stderr."""

from __future__ import annotations

from ckpt_planner.cli.commands import main


def run(argv: list, capsys) -> tuple[int, str]:
    """The CLI's exit code and what it wrote to stderr."""
    code = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    return code, err


def one_line(err: str) -> str:
    """The single line of an error (fails the test on a traceback or several lines)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
