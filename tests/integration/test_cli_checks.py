"""What the ``xreduced`` and ``xreduce`` commands say about themselves and about a daemon that is not there.

Each command runs as a user runs it, in its own process (``python -m``), with no ``XREDUCE_*`` variable
but those a test sets.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

TIMEOUT = 60
"""Seconds a command may take before the test fails rather than hangs (a guard, not a bound)."""


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("XREDUCE_")}
    return subprocess.run([sys.executable, "-m", module, *args], env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT)


def _free_address() -> str:
    """A loopback ``host:port`` nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_xreduced_help_lists_plan_as_a_command():
    out = _run("xreduced", "--help")
    assert out.returncode == 0, out.stderr
    assert "\ncommands:\n" in out.stdout, out.stdout
    assert re.search(r"^ +plan +print the reduction plan", out.stdout, re.MULTILINE), out.stdout
    assert "--listen" in out.stdout  # the daemon's own flags stay


@pytest.mark.parametrize(("env", "message"), [
    ({"XREDUCE_LISTEN": "127.0.0.1:65536"}, "XREDUCE_LISTEN must be host:port or unix:PATH; got '127.0.0.1:65536' "
                                            "(port 65536 is not in 0..65535; 0 picks a free port)"),
    ({"XREDUCE_LISTEN": "127.0.0.1:99999"}, "XREDUCE_LISTEN must be host:port or unix:PATH; got '127.0.0.1:99999' "
                                            "(port 99999 is not in 0..65535; 0 picks a free port)"),
    ({"XREDUCE_LISTEN": "127.0.0.1:0", "XREDUCE_NODE_ADDRESS": "999.1.1.1"},
     "XREDUCE_NODE_ADDRESS must be an IP address or a host name, without a port; got '999.1.1.1' (not an IPv4 "
     "address)"),
], ids=["listen-65536", "listen-99999", "node-address-999"])
def test_xreduced_refuses_a_malformed_address_from_the_environment(env, message):
    run = _run("xreduced", "--backend", "numpy", env=env)
    assert run.returncode == 2, run.stderr
    assert run.stderr == f"xreduced: {message}\n"


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_status_of_an_address_where_no_daemon_listens_says_so_and_how_to_start_one(tmp_path, where):
    address = _free_address() if where == "tcp" else f"unix:{tmp_path}/nobody.sock"
    run = _run("xreduce._cli", "status", "--address", address)
    assert run.returncode == 1, run.stderr
    assert run.stdout == ""
    assert run.stderr.startswith(f"xreduce status: no daemon answers at {address} (failed to connect"), run.stderr
    assert run.stderr.rstrip().endswith(f"); start one there (xreduced --listen {address}), or check --address and "
                                        "XREDUCE_ADDRESS"), run.stderr
    assert "Traceback" not in run.stderr


def test_status_waits_connect_timeout_for_a_host_that_does_not_answer():
    with socket.socket() as silent:  # the kernel takes the connection; nothing ever speaks on it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        run = _run("xreduce._cli", "status", "--address", address, "--connect-timeout", "0.5")
    assert run.returncode == 1, run.stderr
    assert run.stderr.startswith(f"xreduce status: no daemon answers at {address} (no connection within 0.5s); "
                                 f"start one there (xreduced --listen {address})"), run.stderr


def test_status_connect_timeout_must_be_positive():
    bad = _run("xreduce._cli", "status", "--connect-timeout", "0")
    assert bad.returncode == 2 and "--connect-timeout must be positive; got 0.0" in bad.stderr, bad.stderr


@pytest.mark.parametrize(("args", "env", "message"), [
    ([], {"XREDUCE_ADDRESS": "localhost"},
     "xreduce status: XREDUCE_ADDRESS must be host:port or unix:PATH; got 'localhost' (no port)"),
    (["--address", "localhost"], {}, "--address must be host:port or unix:PATH; got 'localhost' (no port)"),
    (["--address", "127.0.0.1:0"], {}, "--address must be host:port or unix:PATH; got '127.0.0.1:0' "
                                       "(port 0 is not in 1..65535)"),
], ids=["env-no-port", "arg-no-port", "arg-port-0"])
def test_status_refuses_a_malformed_address_at_once_naming_it(args, env, message):
    run = _run("xreduce._cli", "status", *args, env=env)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr, run.stderr
    assert "unavailable" not in run.stderr and "443" not in run.stderr, run.stderr
