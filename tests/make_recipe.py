"""What a Makefile target would run, read without running it (``make -n``), for the tests that check
the one-command regeneration of committed results (``make eval``, ``plan-study``, ``numerics``,
``repro``)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe(target: str, *variables: str) -> list[str]:
    """The shell commands of ``make TARGET VARIABLES...``, printed by ``make -n -s``, not run.

    A recipe line continued with a backslash is one command here. Where the venv's stamp is older
    than ``pyproject.toml`` (a fresh worktree beside an existing venv) the output also holds the
    venv's recipe, so callers pick the commands they check (``tool_args``) rather than parse every
    line. The suite runs under ``make test``, so a missing ``make`` is a failure, not a skip.
    """
    text = subprocess.run(["make", "-n", "-s", "-C", str(ROOT), target, *variables], capture_output=True,
                          text=True, check=True).stdout
    return text.replace("\\\n", " ").splitlines()


def tool_args(commands: list[str], tool: str, subcommand: str | None = None) -> list[list[str]]:
    """The arguments after ``TOOL [SUBCOMMAND]`` of each command that runs it, in order.

    ``tool`` matches a word that is the tool or a path ending in ``/tool`` (``.venv/bin/kvq-eval``),
    wherever it stands (after ``VAR=value`` assignments, inside a ``for ... do`` loop); shell
    comments are dropped.
    """
    found = []
    for line in commands:
        if tool not in line:
            continue
        argv = shlex.split(line, comments=True)
        for i, word in enumerate(argv):
            if word != tool and not word.endswith("/" + tool):
                continue
            rest = argv[i + 1:]
            if subcommand is None:
                found.append(rest)
            elif rest[:1] == [subcommand]:
                found.append(rest[1:])
            break
    return found
