"""The environment of the child processes tests start (scripts, test modules run as scripts)."""

from __future__ import annotations

import os

SUPPORT = os.path.dirname(os.path.abspath(__file__))


def child_env() -> dict[str, str]:
    """This process's environment, unbuffered, with this folder on PYTHONPATH.

    A child imports ``xreduce`` and ``xreduced`` as this process does (installed,
    or through the PYTHONPATH it inherits); a test module that runs itself as a
    child also finds the helpers here, as pytest's ``pythonpath`` gives them to it.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, env.get("PYTHONPATH")) if p)
    return env
