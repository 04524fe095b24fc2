"""Reading deploy/: the Dockerfiles, the compose files and the Kubernetes manifests, for the deploy tests."""

from __future__ import annotations

import pathlib
import re
import shlex

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_CLUSTER = K8S / "cluster"
"""The manifests of a job across nodes (their own DaemonSet, Service and Job)."""
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.smoke.yml")
"""The one-host compose files, whose services also run as local processes."""
CLUSTER_COMPOSE_FILE = "docker-compose.cluster.yml"
"""Two nodes on their own network: needs an engine (their addresses exist only there)."""
SOCKET_DIR = "/run/xreduce"
IMAGE_WORKDIR = "/opt/xreduce"


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


def load_compose(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def load_k8s(directory: pathlib.Path = K8S) -> dict[str, dict]:
    """{kind: manifest} over the ``*.yaml`` of ``directory``, deploy/k8s by default (one object of each kind)."""
    docs = [d for path in sorted(directory.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
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


def is_daemon(service: dict) -> bool:
    """Whether a compose service is a daemon: it has a healthcheck of its own (clients disable the image's)."""
    return "healthcheck" in service and not service["healthcheck"].get("disable")
