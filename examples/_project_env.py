"""Lets an example run from a shell that never activated the project's environment.

The examples need xreduce, which the README's commands install into the
virtual environment ``.venv`` at the repository's root. Imported before
anything else, this module checks that this interpreter has xreduce; when it
has not, it runs the example again with ``.venv/bin/python``, the same
arguments and the same working directory, or, when that environment does not
exist or lacks xreduce too, exits with the commands to run.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"


def _run_under_the_project_env() -> None:
    if importlib.util.find_spec("xreduce") is not None:
        return
    python = VENV / "bin" / "python"
    if python.exists() and pathlib.Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(python, [str(python), *sys.argv])
    script = pathlib.Path(sys.argv[0]).resolve()
    example = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    sys.exit(f"{sys.argv[0]}: xreduce is not installed for {sys.executable}. From {ROOT}, install the project "
             "into its environment and run the example there:\n"
             "  python3 -m venv .venv && .venv/bin/pip install -e '.[dev]'\n"
             f"  .venv/bin/python {shlex.join([str(example), *sys.argv[1:]])}")


_run_under_the_project_env()
