"""deploy/ in action: the services of each compose file and the Kubernetes Job, run as local processes.

No Docker engine and no cluster run on these machines (tests/unit/test_deploy.py checks the files
themselves), so every default service of each compose file runs as a local process, in depends_on
order, with its environment: ``xreduced`` becomes ``python -m xreduced``, ``python`` this
interpreter, each named volume a short temporary directory, the image's working directory the
repository, the socket group this user's group and the metrics port a free loopback port; ``user``,
``group_add``, ``ipc`` and ``shm_size`` have no local meaning and are not applied. The healthcheck is
the compose file's own command, run until it passes; the trainers must finish with identical
checksums. The Kubernetes Job's pods run the same way against a daemon configured by the ConfigMap
and probed by the DaemonSet's readiness command (XREDUCE_BACKEND cupy becomes numpy without a GPU).
"""

from __future__ import annotations

import grp
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from deploy_files import (
    COMPOSE_FILES,
    IMAGE_WORKDIR,
    ROOT,
    SOCKET_DIR,
    as_list,
    environment,
    image_env,
    instruction,
    is_daemon,
    load_compose,
    load_k8s,
    mounts,
    seconds,
)

STEP = re.compile(r"^(?:\[p(\d+)\] )?step +(\d+) +loss (\S+) +weights ([0-9a-f]{16})$", re.M)


# ---------------------------------------------------------------------------------------------
# Running the services as local processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Local:
    """Maps container paths, commands and settings onto this machine (see the module docstring)."""

    def __init__(self, tmp: pathlib.Path, volumes: dict[str, str]):
        self.tmp = tmp
        self.paths = {target: str(tmp / name) for target, name in volumes.items()}
        for path in self.paths.values():
            os.makedirs(path, exist_ok=True)
        self.paths[IMAGE_WORKDIR] = str(ROOT)
        self.procs: list[subprocess.Popen] = []
        self.metrics: str | None = None
        """The local address XREDUCE_METRICS_LISTEN became."""

    def path(self, value: str) -> str:
        for target, local in self.paths.items():
            value = re.sub(re.escape(target) + r"(?=/|$|\s)", local, value)
        return value

    def argv(self, argv: list[str]) -> list[str]:
        argv = [self.path(a) for a in argv]
        if argv[0] == "xreduced":
            return [sys.executable, "-m", "xreduced", *argv[1:]]
        if argv[0] == "python":
            return [sys.executable, *argv[1:]]
        if argv[0] == "sh":
            return argv
        raise AssertionError(f"no local equivalent for {argv[0]!r}")

    def env(self, env: dict[str, str]) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("XREDUCE_", "KERAS_DISTRIBUTION_"))}
        out = {**base, "PYTHONUNBUFFERED": "1"}
        for key, value in env.items():
            if key == "XREDUCE_SOCKET_GROUP":
                value = grp.getgrgid(os.getgid()).gr_name
            elif key == "XREDUCE_METRICS_LISTEN":
                self.metrics = value = self.metrics or f"127.0.0.1:{free_port()}"
            elif key == "XREDUCE_BACKEND" and value == "cupy" and importlib.util.find_spec("cupy") is None:
                value = "numpy"
            elif key in ("PATH", "CUPY_CACHE_DIR"):
                continue
            out[key] = self.path(value)
        return out

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w+")
        proc = subprocess.Popen(self.argv(argv), env=self.env(env), cwd=self.path(cwd), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = log
        proc.name = name
        self.procs.append(proc)
        return proc

    def check(self, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), env=self.env(env), cwd=str(ROOT), capture_output=True,
                              text=True, timeout=timeout)

    def wait_healthy(self, proc: subprocess.Popen, argv: list[str], env: dict[str, str], timeout: float,
                     deadline: float = 30.0) -> None:
        end = time.monotonic() + deadline
        while True:
            assert proc.poll() is None, f"{proc.name} exited {proc.returncode}:\n{output(proc)}"
            r = self.check(argv, env, timeout)
            if r.returncode == 0:
                return
            assert time.monotonic() < end, f"{proc.name} not healthy after {deadline}s:\n{r.stderr}\n{output(proc)}"
            time.sleep(0.2)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            proc.log.close()


def assert_metrics(address: str) -> None:
    """The daemon serves Prometheus metrics there, its calls counted."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200
        body = r.read().decode()
    assert re.search(r"^xreduce_\w+", body, re.M), body[:2000]


def output(proc: subprocess.Popen) -> str:
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()


def wait(procs: list[subprocess.Popen], timeout: float) -> None:
    """Waits for every process (bounded); on a failure or the deadline the rest are killed."""
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > end or any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            break
        time.sleep(0.05)


def runs(procs: list[subprocess.Popen]) -> dict[str, list[tuple[str, str]]]:
    """{process: [(loss, checksum) per step]}; a launcher's ``[pN]`` lines count as process N."""
    out: dict[str, list[tuple[str, str]]] = {}
    for proc in procs:
        for p, step, loss, checksum in STEP.findall(output(proc)):
            steps = out.setdefault(f"{proc.name}/p{p}" if p else proc.name, [])
            assert int(step) == len(steps)
            steps.append((loss, checksum))
    return out


def assert_agree(procs: list[subprocess.Popen], expected: int) -> None:
    logs = "\n".join(f"--- {p.name} (exit {p.returncode})\n{output(p)}" for p in procs)
    assert all(p.returncode == 0 for p in procs), logs
    by_process = runs(procs)
    assert len(by_process) == expected, logs
    steps = list(by_process.values())
    assert steps[0] and all(s == steps[0] for s in steps), logs
    assert float(steps[0][-1][0]) < float(steps[0][0][0]), logs  # the loss fell


@pytest.fixture
def short_tmp():
    """A short directory for unix sockets (their paths are limited to 107 bytes)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="xrd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def order(services: dict) -> list[str]:
    """The services in depends_on order."""
    done: list[str] = []
    while len(done) < len(services):
        ready = [n for n, s in services.items() if n not in done and set(s.get("depends_on") or {}) <= set(done)]
        assert ready, f"depends_on cycle among {sorted(set(services) - set(done))}"
        done.extend(ready)
    return done


@pytest.mark.parametrize("name", COMPOSE_FILES)
@pytest.mark.slow
def test_compose_services_run_locally(name, short_tmp):
    doc = load_compose(name)
    services = {n: s for n, s in doc["services"].items() if not s.get("profiles")}
    volumes = {t: v for s in services.values() for t, v in mounts(s).items()}
    local = Local(short_tmp, volumes)
    started: dict[str, subprocess.Popen] = {}
    try:
        for svc in order(services):
            s = services[svc]
            image = s["build"]["dockerfile"].removeprefix("deploy/")
            env = {**image_env(image), **environment(s)}
            argv = as_list(s.get("entrypoint")) or [json.loads(e) for e in instruction(image, "ENTRYPOINT")][0]
            argv = argv + as_list(s.get("command"))
            for dep, cond in (s.get("depends_on") or {}).items():
                assert cond["condition"] == "service_healthy", cond
                d = services[dep]
                test = d["healthcheck"]["test"]
                check = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
                denv = {**image_env(d["build"]["dockerfile"].removeprefix("deploy/")), **environment(d)}
                local.wait_healthy(started[dep], check, denv, seconds(d["healthcheck"]["timeout"]))
            if is_daemon(s):
                # Before the daemon runs, its healthcheck must fail.
                test = s["healthcheck"]["test"]
                r = local.check(test[1:], env, seconds(s["healthcheck"]["timeout"]))
                assert r.returncode != 0, "the healthcheck passed with no daemon running"
            started[svc] = local.start(svc, argv, env, s.get("working_dir", IMAGE_WORKDIR))
        jobs = [p for n, p in started.items() if not is_daemon(services[n])]
        wait(jobs, 60)
        assert_agree(jobs, expected=2)
        if local.metrics:
            assert_metrics(local.metrics)
        for svc, proc in started.items():
            if is_daemon(services[svc]):
                assert proc.poll() is None, output(proc)
                proc.send_signal(signal.SIGTERM)  # docker stop
                assert proc.wait(seconds(services[svc]["stop_grace_period"])) == 0, output(proc)
    finally:
        local.stop_all()


@pytest.mark.slow
def test_k8s_job_runs_locally(short_tmp):
    k = load_k8s()
    cm, ds, job = k["ConfigMap"], k["DaemonSet"], k["Job"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    local = Local(short_tmp, {SOCKET_DIR: "hostpath-run-xreduce"})
    env = {**image_env("Dockerfile.gpu"), **cm["data"]}
    try:
        daemon = local.start("xreduced", [json.loads(e) for e in instruction("Dockerfile.gpu", "ENTRYPOINT")][0],
                             env, IMAGE_WORKDIR)
        probe = c["readinessProbe"]
        local.wait_healthy(daemon, probe["exec"]["command"], env, probe["timeoutSeconds"])
        (t,) = job["spec"]["template"]["spec"]["containers"]
        pods = []
        for index in range(job["spec"]["completions"]):
            penv = {}
            for e in t["env"]:
                if "value" in e:
                    penv[e["name"]] = e["value"]
                else:  # the completion index annotation
                    assert "job-completion-index" in e["valueFrom"]["fieldRef"]["fieldPath"]
                    penv[e["name"]] = str(index)
            pods.append(local.start(f"trainer-{index}", t["command"] + t.get("args", []),
                                    {**image_env("Dockerfile"), **penv}, t["workingDir"]))
        wait(pods, 60)
        assert_agree(pods, expected=job["spec"]["completions"])
        assert_metrics(local.metrics)
        liveness = c["livenessProbe"]
        assert local.check(liveness["exec"]["command"], env, liveness["timeoutSeconds"]).returncode == 0
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]) == 0, output(daemon)
    finally:
        local.stop_all()
