"""The training corpus: the Python standard library sources of the interpreter that runs training.

Deterministic: files are read in sorted order; files that are not valid UTF-8 are skipped. A fixed
set of modules (and their test files, so no test leaks their API usage) is held out for evaluation.
The standard library is under the PSF licence (see README).
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field

# Held out for evaluation: small, self-contained, idiomatic modules present in CPython 3.8 .. 3.13.
# A path ending in "/" is a package (every .py file under it).
HELD_OUT: tuple[str, ...] = (
    "argparse.py", "csv.py", "difflib.py", "fractions.py", "heapq.py", "json/", "shlex.py",
    "statistics.py", "string.py", "textwrap.py",
)
# Never used: third-party code and generated or data-like files.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "config-")


@dataclass
class Corpus:
    root: str
    extra_roots: list[str] = field(default_factory=list)
    train: list[tuple[str, str]] = field(default_factory=list)      # (relative path, text)
    held_out: list[tuple[str, str]] = field(default_factory=list)
    skipped_non_utf8: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {"root": self.root, "extra_roots": self.extra_roots, "train_files": len(self.train),
                "train_bytes": sum(len(t.encode()) for _, t in self.train),
                "held_out_files": len(self.held_out),
                "held_out_bytes": sum(len(t.encode()) for _, t in self.held_out),
                "held_out_modules": list(HELD_OUT), "skipped_non_utf8": self.skipped_non_utf8}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _held_out(rel: str) -> bool:
    for h in HELD_OUT:
        if h.endswith("/"):
            if rel.startswith(h):
                return True
        elif rel == h:
            return True
    return False


def _leaks_held_out(rel: str) -> bool:
    """Test files of a held-out module (test/test_json/..., test/test_csv.py) stay out of training."""
    base = os.path.basename(rel[:-1] if rel.endswith("/") else rel)
    parts = rel.split("/")
    if "test" not in parts and "tests" not in parts:
        return False
    for h in HELD_OUT:
        name = h.rstrip("/").removesuffix(".py")
        if any(p in (f"test_{name}", f"test_{name}.py") for p in parts) or base == f"test_{name}.py":
            return True
    return False


def _py_files(root: str) -> list[str]:
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith(EXCLUDED_DIRS))
        for f in sorted(files):
            if f.endswith(".py"):
                paths.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return sorted(paths)


def build_corpus(root: str | None = None, max_files: int | None = None,
                 extra_roots: tuple[str, ...] | list[str] = ()) -> Corpus:
    """Collect every .py file under `root` (default: this interpreter's stdlib), sorted; then the
    files of each `extra_roots` tree (e.g. another CPython's Lib/ with its test suite) whose
    relative path `root` does not have."""
    root = os.path.abspath(root or stdlib_root())
    extra = [os.path.abspath(r) for r in extra_roots]
    for r in [root] + extra:
        if not os.path.isdir(r):
            raise FileNotFoundError(f"corpus root {r} is not a directory")
    seen: set[str] = set()
    items: list[tuple[str, str]] = []          # (root, relative path)
    for r in [root] + extra:
        for rel in _py_files(r):
            if rel not in seen:
                seen.add(rel)
                items.append((r, rel))
    if max_files is not None:
        items = items[:max_files]
    c = Corpus(root=root, extra_roots=extra)
    for r, rel in items:
        try:
            with open(os.path.join(r, rel), "rb") as fh:
                text = fh.read().decode("utf-8")
        except UnicodeDecodeError:
            c.skipped_non_utf8.append(rel)
            continue
        except OSError:
            continue
        if not text.strip():
            continue
        if _held_out(rel):
            c.held_out.append((rel, text))
        elif not _leaks_held_out(rel):
            c.train.append((rel, text))
    if not c.train:
        raise FileNotFoundError(f"no Python sources found under {root}")
    return c
