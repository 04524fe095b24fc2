"""The house rules of docs/architecture.md, checked on the code.

* no import loops among the modules of client/ and server/ (a loop through a
  package's ``__init__`` does not count: it runs for every submodule anyway);
* the daemon imports nothing of the SDK but the shared wire package and the
  generated stubs;
* the SDK imports the daemon only to start an embedded one;
* ``import xreduce`` loads neither the daemon nor the bench tooling, nor TensorFlow;
* every module that docs/architecture.md names exists, and every module of
  client/ and server/ is named there.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").exists():
    ROOT = ROOT.parent
SOURCES = {"client": ROOT / "client", "server": ROOT / "server"}
SDK_MAY_IMPORT_DAEMON = {"xreduce._embedded"}
"""Where the SDK may import the daemon: to start an embedded one on request."""


def _modules() -> dict[str, Path]:
    mods = {}
    for base in SOURCES.values():
        for f in base.rglob("*.py"):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and ".v1" not in ".".join(parts):
                mods[".".join(parts)] = f
    return mods


def _imports(module: str, path: Path) -> set[str]:
    """Every module ``module`` imports, at any depth of its code (lazy imports included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _imports(m, f) if n in mods and n != m and mods[n].name != "__init__.py"}
            for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_loops():
    assert _cycles(_graph()) == []


def test_the_daemon_imports_only_the_wire_package_and_the_stubs_of_the_sdk():
    wrong = {}
    for m, f in _modules().items():
        if m.startswith("xreduced"):
            sdk = {n for n in _imports(m, f) if n == "xreduce" or n.startswith("xreduce.")}
            bad = {n for n in sdk if not n.startswith(("xreduce.wire", "xreduce.v1"))}
            if bad:
                wrong[m] = sorted(bad)
    assert wrong == {}


def test_the_sdk_imports_the_daemon_only_to_embed_it():
    wrong = {m: sorted(n for n in _imports(m, f) if n.split(".")[0] == "xreduced")
             for m, f in _modules().items() if m.startswith("xreduce") and not m.startswith("xreduced")
             and m not in SDK_MAY_IMPORT_DAEMON}
    assert {m: v for m, v in wrong.items() if v} == {}


def test_import_xreduce_loads_neither_the_daemon_nor_the_bench_tooling():
    code = ("import sys, xreduce, xreduce.distribute, xreduce.distribution\n"
            "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
            "('xreduced', 'xreduce_bench', 'torch', 'mpi4py', 'matplotlib', 'tensorflow', 'keras')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_docs_architecture_names_every_module_and_only_modules_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:xreduced|xreduce)(?:\.[a-z0-9_]+)*)`", text))
    modules = set(_modules())
    packages = {m for m, f in _modules().items() if f.name == "__init__.py"}
    assert sorted(named - modules - {"xreduce.v1"}) == []
    assert sorted(modules - named - packages) == []
