"""The package's import graph: no circle among specfire's modules and no import of a higher layer.

Every import statement counts, at module level or inside a function (a deferred import is still a
dependency). Run as a script to print the graph's circles and upward imports."""
from __future__ import annotations

import ast
import os
import sys

from repo import REPO

ROOT = os.path.join(REPO, "specfire")

# Layers, lowest first: a module may import its own layer and those below it, never one above.
# A name is a module or a package prefix of "specfire."; the longest prefix decides.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "env", "threads", "params", "config", "chat_template", "tokenizer", "grammar"),
    ("kernels",),
    ("layers",),
    ("model", "quantize"),
    ("runtime",),
    ("parallel",),
    ("report", "api", "flags"),
    ("serve", "cli", "info", "train", "__main__"),
)


def module_names() -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under specfire/."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def imports(name: str, path: str, modules: set[str]) -> set[str]:
    """The specfire modules `name` imports at run time (a `from pkg import mod` names the module
    itself; imports under `if TYPE_CHECKING:` are for annotations and do not count)."""
    is_pkg = path.endswith("__init__.py")
    pkg = name if is_pkg else name.rpartition(".")[0]
    got: set[str] = set()
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    typing_only = set()          # `if TYPE_CHECKING:` imports: annotations, never run
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            typing_only.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
            for b in bases:
                if b.split(".")[0] == "specfire":
                    got.add(b)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            parts = pkg.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        if base.split(".")[0] != "specfire":
            continue
        for a in node.names:
            sub = f"{base}.{a.name}"
            got.add(sub if sub in modules else base)
    return {m for m in got if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    mods = module_names()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def layer(name: str) -> int | None:
    """The layer of a module (None: the package's root __init__, which re-exports the API)."""
    rest = name.split(".", 1)[1] if "." in name else ""
    if not rest:
        return None
    first = rest.split(".")[0]
    for i, names in enumerate(LAYERS):
        if first in names:
            return i
    raise AssertionError(f"{name}: no layer in tests/test_imports.py LAYERS; add its package there")


def upward(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module sits in a higher layer."""
    bad = []
    for m, deps in g.items():
        lm = layer(m)
        if lm is None:
            continue
        for d in deps:
            ld = layer(d)
            if ld is not None and ld > lm:
                bad.append((m, d))
    return sorted(bad)


def test_checker_finds_a_circle_and_an_upward_import():
    """The checks themselves: a made-up graph with a circle and an upward edge is caught."""
    g = {"specfire.runtime.a": {"specfire.runtime.b"}, "specfire.runtime.b": {"specfire.runtime.a"},
         "specfire.kernels.k": {"specfire.runtime.a"}, "specfire.config": set()}
    assert cycles(g) == [["specfire.runtime.a", "specfire.runtime.b"]]
    assert upward(g) == [("specfire.kernels.k", "specfire.runtime.a")]


def test_relative_imports_resolve(tmp_path):
    """`from ..x import y` and `from . import mod` name the right modules."""
    pkg = tmp_path / "specfire" / "runtime"
    pkg.mkdir(parents=True)
    f = pkg / "engine.py"
    f.write_text("from ..config import X\nfrom . import spec\ndef f():\n    from .trunk import T\n")
    mods = {"specfire.config", "specfire.runtime.spec", "specfire.runtime.trunk", "specfire.runtime.engine"}
    assert imports("specfire.runtime.engine", str(f), mods) == {"specfire.config", "specfire.runtime.spec",
                                                                "specfire.runtime.trunk"}


def test_no_import_circles():
    assert cycles(graph()) == []


def test_no_upward_imports():
    assert upward(graph()) == []


if __name__ == "__main__":
    gr = graph()
    for c in cycles(gr):
        print("circle:", " ".join(c))
    for a, b in upward(gr):
        print("upward:", a, "->", b)
