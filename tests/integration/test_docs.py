"""The command blocks of README.md and docs/*.md print what they show.

Two kinds of fenced block show output, and both are run:

- ``pycon`` blocks (``>>>`` prompts) run with doctest: the blocks of one file are one session, in
  a fresh interpreter, inside ``xreduce.serve_embedded()``, which stands in for the daemon of the
  README's first command.
- ``console`` blocks (``$`` prompts) run each command as a user's fresh shell does after the
  README's two commands and its activation line (``. .venv/bin/activate``): bash from the repository
  root, an environment with the system's ``PATH`` and nothing of this process's ``XREDUCE_*``, the
  activation line run first; ``.venv`` in a command is the virtual environment that runs the tests
  (the README's, in CI). They compare what each command prints (stdout and stderr together) with
  the lines below it. The commands of one file share one daemon (8 host devices, metrics on), which
  stands in for the one the README's first command left running: in a command, ``127.0.0.1:50551``
  names it and ``127.0.0.1:9464`` its metrics endpoint, and ``XREDUCE_ADDRESS`` points at it; a
  daemon the command starts itself listens on a free port. Their addresses print as those of the
  docs. A line ``^C`` is Ctrl-C: the command runs until it has printed the lines above it, then
  gets SIGINT. A command whose program is not installed skips the file's remaining commands.

In the expected output ``...`` stands for any text (doctest's ELLIPSIS): it marks what changes
between runs and machines, such as times, memory sizes, temporary paths and the last digits that
depend on the CPU's BLAS kernels. Everything else must match exactly.

A block right after ``<!-- not run: REASON -->`` is not run (it needs a GPU, Docker, or a
benchmark's minutes); the reason stays visible in the markdown source. Any other block that shows
a prompt must be one of the two kinds, so that no output shown goes unchecked.

``python tests/integration/test_docs.py FILE.md`` runs the pycon blocks of one file (the test does so in a
subprocess, so that the SDK's process-wide state stays out of the test process).
"""

from __future__ import annotations

import dataclasses
import doctest
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = pathlib.Path(sys.executable).parent
VENV = BIN.parent
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
ACTIVATE = ". .venv/bin/activate"
"""The line that the README, right after its two commands, tells a user to run in the second terminal."""
DAEMON_ADDRESS = "127.0.0.1:50551"
METRICS_ADDRESS = "127.0.0.1:9464"
TIMEOUT = 90

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    """One fenced block: its info string, the line of its first content line, its lines."""

    path: pathlib.Path
    lang: str
    line: int
    lines: list[str]
    not_run: str | None


@dataclasses.dataclass
class Command:
    """One ``$`` command of a console block, with the output shown below it."""

    line: int
    source: str
    want: list[str]
    interrupt_after: int | None = None


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a markdown file, in order."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        marker = _NOT_RUN.match(previous)
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        found.append(Block(path, opening["lang"], i - len(body) + 1, body, marker and marker["reason"]))
        i += 1
    return found


def commands(block: Block) -> list[Command]:
    """The ``$`` commands of a console block, with continuation lines joined."""
    cmds: list[Command] = []
    lines = iter(enumerate(block.lines, block.line))
    for number, line in lines:
        if line.startswith("$ "):
            source = line[2:]
            while source.endswith("\\"):
                source += "\n" + next(lines)[1]
            cmds.append(Command(number, source, []))
        elif not cmds:
            raise AssertionError(f"{block.path.name}:{number}: a console block starts with a '$ ' command")
        elif line.rstrip() == "^C":
            cmds[-1].interrupt_after = len(cmds[-1].want)
        else:
            cmds[-1].want.append(line)
    return cmds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_env(**extra: str) -> dict[str, str]:
    """A new user's shell before activation: the system's PATH, nothing of this process's XREDUCE_*."""
    env = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONUNBUFFERED": "1", "TERM": "dumb"}
    env.update(extra)
    return env


class _Daemon:
    """A context that runs ``xreduced`` on free ports; ``address`` and ``metrics`` once it serves.

    ``flags`` come first (a later ``--listen`` would win), ``cwd`` is where relative paths in them start.
    """

    def __init__(self, env: dict[str, str], *flags: str, cwd: pathlib.Path = ROOT):
        self.env = env
        self.flags = flags
        self.cwd = cwd
        self.log: list[str] = []
        self.address = self.metrics = ""

    def __enter__(self) -> _Daemon:
        self.proc = subprocess.Popen(
            [str(BIN / "xreduced"), *self.flags, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
             "--backend", "numpy"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=self.env, cwd=self.cwd)
        serving = threading.Event()

        def drain() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                if m := re.search(r"event=metrics address=(\S+)", line):
                    self.metrics = m[1]
                if m := re.search(r"event=serving address=(\S+)", line):
                    self.address = m[1]
                    serving.set()
            serving.set()

        threading.Thread(target=drain, daemon=True).start()
        if not serving.wait(TIMEOUT) or not self.address:
            self.__exit__()
            raise AssertionError("xreduced did not start:\n" + "".join(self.log))
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_VENV_IN_COMMAND = re.compile(r"(?<![\w./-])\.venv/")


def _as_a_user(source: str) -> str:
    """``source`` in the activated shell of the README's second terminal, ``.venv`` this test's environment."""
    return _VENV_IN_COMMAND.sub(f"{VENV}/", f"{ACTIVATE}\n{source}")


def _run(command: Command, env: dict[str, str], cwd: pathlib.Path = ROOT) -> str:
    """Runs one command as a user would in a terminal; returns what it printed."""
    proc = subprocess.Popen(["bash", "-c", _as_a_user(command.source)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            printed.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if command.interrupt_after is not None:
            deadline = time.monotonic() + TIMEOUT
            while not _shown(command, printed) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: to the foreground process group
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(TIMEOUT)
    return "".join(printed)


def _shown(command: Command, printed: list[str]) -> bool:
    """Whether the command has printed what the block shows before its ``^C``: as many lines, the last of
    them among them (a program may print lines the block leaves to an ellipsis, e.g. the daemon's lane)."""
    if len(printed) < command.interrupt_after:
        return False
    if not command.interrupt_after:
        return True
    last = command.want[command.interrupt_after - 1].rstrip() + "\n"
    checker = doctest.OutputChecker()
    return any(checker.check_output(last, line.rstrip() + "\n", doctest.ELLIPSIS) for line in list(printed))


def _check(command: Command, got: str, path: pathlib.Path) -> None:
    want = "".join(line.rstrip() + "\n" for line in command.want)
    got = "".join(line.rstrip() + "\n" for line in got.splitlines())
    checker = doctest.OutputChecker()
    if not checker.check_output(want, got, doctest.ELLIPSIS):
        example = doctest.Example(command.source, want)
        raise AssertionError(f"{path.relative_to(ROOT)}:{command.line}: $ {command.source}\n"
                             + checker.output_difference(example, got, doctest.ELLIPSIS))


def _id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _runnable(path: pathlib.Path, lang: str) -> list[Block]:
    return [b for b in blocks(path) if b.lang == lang and b.not_run is None]


def test_every_block_that_shows_output_is_checked():
    for path in DOCS:
        for block in blocks(path):
            where = f"{path.relative_to(ROOT)}:{block.line}"
            first = next((line for line in block.lines if line.strip()), "")
            if first.startswith("$ ") and block.lang != "console":
                raise AssertionError(f"{where}: a block with '$ ' prompts is a ```console block")
            if first.startswith(">>> ") and block.lang != "pycon":
                raise AssertionError(f"{where}: a block with '>>> ' prompts is a ```pycon block")
            if block.not_run == "":
                raise AssertionError(f"{where}: <!-- not run: ... --> needs its reason")


def test_the_readme_says_to_activate_right_after_its_two_commands():
    readme = blocks(ROOT / "README.md")
    first = [b for b in readme if b.lang == "sh"][:3]
    assert [b.lines for b in first][2:] == [[ACTIVATE]], "the README's third sh block is the activation line"
    between = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[first[1].line:first[2].line]
    said = " ".join(between)
    for what in ("Python 3.11", "busy", "another terminal", "`dev` extra", "grpcurl"):
        assert what in said, f"README: between the test command and the activation line, say {what!r}"


def test_the_readme_test_command_is_what_ci_runs():
    readme = [b for b in blocks(ROOT / "README.md") if b.lang == "sh"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert readme[1].lines[0] in ci, f"README's test command {readme[1].lines[0]!r} is not a line of .ci/run"


in_a_venv = pytest.mark.skipif(not (BIN / "activate").exists(), reason=f"{sys.executable} is not in a virtual "
                               "environment, and the README's user runs these commands in an activated one")


@in_a_venv
@pytest.mark.parametrize("path", [p for p in DOCS if _runnable(p, "console")], ids=_id)
@pytest.mark.timeout(420)  # a file's commands, each bounded by TIMEOUT: the README's start TensorFlow jobs too
def test_console_blocks(path):
    with tempfile.TemporaryDirectory(prefix="xreduce-docs-") as home:
        env = _fresh_env(HOME=home)
        with _Daemon(env) as daemon:
            listen = f"127.0.0.1:{_free_port()}"
            env.update(XREDUCE_ADDRESS=daemon.address, XREDUCE_LISTEN=listen)
            into = {DAEMON_ADDRESS: daemon.address, METRICS_ADDRESS: daemon.metrics}
            back = {daemon.address: DAEMON_ADDRESS, daemon.metrics: METRICS_ADDRESS, listen: DAEMON_ADDRESS}
            for block in _runnable(path, "console"):
                for command in commands(block):
                    program = next(word for word in command.source.split() if "=" not in word)
                    if "/" not in program and shutil.which(program, path=f"{BIN}{os.pathsep}{SYSTEM_PATH}") is None:
                        pytest.skip(f"{program} is not installed ({path.name}:{command.line})")
                    for doc, real in into.items():
                        command.source = command.source.replace(doc, real)
                    got = _run(command, env)
                    for real, doc in back.items():
                        got = got.replace(real, doc)
                    _check(command, got, path)


def _block_with(path: pathlib.Path, lang: str, text: str) -> Block:
    found = [b for b in blocks(path) if b.lang == lang and any(text in line for line in b.lines)]
    assert len(found) == 1, f"{path.name}: one {lang} block holds {text!r}; found {len(found)}"
    return found[0]


@in_a_venv
@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is missing")
def test_the_tls_example_of_sdk_md_prints_what_it_shows(tmp_path):
    """sdk.md's ``sdk.py``, against the mutual-TLS daemon with a token that operations.md makes.

    Its console block is marked not run (the generic runner has no certificates); this runs it.
    """
    make = _block_with(ROOT / "docs" / "operations.md", "sh", "openssl req -x509")
    daemon_line = next(line for line in make.lines if line.startswith("xreduced "))
    script = "\n".join(make.lines[:make.lines.index(daemon_line)])
    subprocess.run(["bash", "-c", script], cwd=tmp_path, env=_fresh_env(HOME=str(tmp_path)), check=True,
                   capture_output=True, timeout=TIMEOUT)  # the certificates and the token
    program = _block_with(ROOT / "docs" / "sdk.md", "python", "HierarchicalCopyAllReduce(address=")
    sdk_md = blocks(ROOT / "docs" / "sdk.md")
    shown = sdk_md[sdk_md.index(program) + 1]
    assert shown.lang == "console" and "python sdk.py" in "".join(shown.lines)
    env = _fresh_env(HOME=str(tmp_path))
    with _Daemon(env, *daemon_line.split()[1:], cwd=tmp_path) as daemon:
        (tmp_path / "sdk.py").write_text("\n".join(program.lines).replace(DAEMON_ADDRESS, daemon.address) + "\n")
        for command in commands(shown):
            _check(command, _run(command, env, cwd=tmp_path), ROOT / "docs" / "sdk.md")


@pytest.mark.parametrize("path", [p for p in DOCS if _runnable(p, "pycon")], ids=_id)
def test_pycon_blocks(path):
    with tempfile.TemporaryDirectory(prefix="xreduce-docs-") as home:
        proc = subprocess.run([sys.executable, __file__, str(path)], cwd=ROOT, env=_fresh_env(HOME=home),
                              capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run_pycon(path: pathlib.Path) -> int:
    """Runs the pycon blocks of one file as one doctest session; returns the number of failures."""
    import xreduce

    text = [""] * len(path.read_text(encoding="utf-8").splitlines())
    for block in _runnable(path, "pycon"):
        text[block.line - 1:block.line - 1 + len(block.lines)] = block.lines
    name = str(path.relative_to(ROOT))
    test = doctest.DocTestParser().get_doctest("\n".join(text) + "\n", {}, name, name, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    with xreduce.serve_embedded():
        runner.run(test)
    return runner.summarize(verbose=False).failed


if __name__ == "__main__":
    sys.exit(min(_run_pycon(pathlib.Path(sys.argv[1]).resolve()), 1))
