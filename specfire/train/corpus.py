"""The training corpus: Python sources of the interpreter that runs training.

Two kinds: `stdlib` (the standard library alone, the first bundled model's corpus) and `site`
(the standard library plus every permissively licensed distribution in site-packages, by package,
filtered and deduplicated: sources.py). Deterministic: files are read in sorted order. A fixed set
of standard-library modules (and their test files, so no test leaks their API usage) and, for
`site`, whole packages are held out for evaluation.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import asdict, dataclass, field

# Held out for evaluation: small, self-contained, idiomatic modules present in CPython 3.8 .. 3.13.
# A path ending in "/" is a package (every .py file under it).
HELD_OUT: tuple[str, ...] = (
    "argparse.py", "csv.py", "difflib.py", "fractions.py", "heapq.py", "json/", "shlex.py",
    "statistics.py", "string.py", "textwrap.py",
)
# Whole distributions held out of the `site` corpus: small, modern, typed pure-Python packages that
# torch / transformers / pytest depend on, so any environment that trains the model has them.
HELD_OUT_PACKAGES: tuple[str, ...] = ("jinja2", "fsspec", "packaging", "pluggy", "iniconfig", "filelock")
# Never used: third-party code and generated or data-like files.
EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__", "config-")


@dataclass
class Corpus:
    root: str
    extra_roots: list[str] = field(default_factory=list)
    train: list[tuple[str, str]] = field(default_factory=list)      # (relative path, text)
    held_out: list[tuple[str, str]] = field(default_factory=list)
    skipped_non_utf8: list[str] = field(default_factory=list)
    held_out_stdlib: list[tuple[str, str]] = field(default_factory=list)   # `site`: the stdlib part
    packages: list = field(default_factory=list)                           # `site`: sources.Package
    hash_ceiling: int = 2**32        # train holds only files whose path hash is below this (a prefilter)

    def summary(self) -> dict:
        return {"root": self.root, "extra_roots": self.extra_roots, "train_files": len(self.train),
                "train_bytes": sum(len(t.encode()) for _, t in self.train),
                "held_out_files": len(self.held_out),
                "held_out_bytes": sum(len(t.encode()) for _, t in self.held_out),
                "held_out_modules": list(HELD_OUT), "skipped_non_utf8": self.skipped_non_utf8,
                "held_out_stdlib_files": len(self.held_out_stdlib),
                "packages": [asdict(p) for p in self.packages]}


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


def build_site_corpus(held_out_packages: tuple[str, ...] = HELD_OUT_PACKAGES, max_files: int | None = None,
                      dirs: list[str] | None = None, log=None, max_bytes: int | None = None) -> Corpus:
    """The standard library (its HELD_OUT modules held out) and every permissively licensed
    distribution of site-packages (`held_out_packages` held out whole), filtered and deduplicated.
    `held_out` holds the held-out packages' files, `held_out_stdlib` the held-out stdlib modules;
    `max_files` caps the files read per package (a smoke test). `max_bytes`: the caller keeps only
    `subsample(train, max_bytes)`, so training files whose path hash cannot fall in that sample
    (sizes from the file system, with a 30% margin for what the filters drop) are not even read:
    the same kind of sample, in seconds instead of reading every file."""
    from . import sources

    root = stdlib_root()
    std = build_corpus(root)
    c = Corpus(root=root, extra_roots=sources.site_dirs() if dirs is None else list(dirs))
    c.skipped_non_utf8 = std.skipped_non_utf8
    held = {sources._norm_name(n) for n in held_out_packages}
    dists = sources.distributions(dirs)
    stdpkg = sources.stdlib_package()
    c.packages.append(stdpkg)
    # held-out text first: its lines also keep copies of it out of training
    held_dedup = sources.Deduper()
    for pkg, files in dists:
        if pkg.name not in held:
            continue
        pkg.role = "held_out" if pkg.permissive else "refused"
        if not pkg.permissive:
            continue
        for rel, path in files[:max_files]:
            text, why = sources.file_filter(rel, sources.read(path) or b"")
            if text is None:
                pkg.drop(why)
                continue
            held_dedup.seen(text)
            c.held_out.append((f"{pkg.name}/{rel}", text))
            pkg.files += 1
            pkg.bytes += len(text.encode())
    for rel, text in std.held_out:
        held_dedup.seen(text)
        c.held_out_stdlib.append((rel, text))
    dedup = sources.Deduper()
    c.hash_ceiling = _prefilter_cut(std.train, [(p, f) for p, f in dists if p.name not in held and p.permissive],
                                    max_files, max_bytes)

    def keep(key: str) -> bool:
        return c.hash_ceiling >= 2**32 or _path_hash(key) < c.hash_ceiling

    def add(pkg, rel: str, text: str) -> None:
        if held_dedup.overlap(text) >= sources.NEAR_DUP_FRAC:
            pkg.drop("held_out_copy")
            return
        why = dedup.seen(text)
        if why:
            pkg.drop(why)
            return
        c.train.append((f"{pkg.name}/{rel}" if pkg is not stdpkg else rel, text))
        pkg.files += 1
        pkg.bytes += len(text.encode())

    for rel, text in std.train[:max_files]:
        if keep(rel):
            add(stdpkg, rel, text)
    for pkg, files in dists:
        if pkg.name in held:
            continue
        c.packages.append(pkg)
        if not pkg.permissive:
            continue
        for rel, path in files[:max_files]:
            if not keep(f"{pkg.name}/{rel}"):
                continue
            text, why = sources.file_filter(rel, sources.read(path) or b"")
            if text is None:
                pkg.drop(why)
            else:
                add(pkg, rel, text)
        if log and pkg.files:
            log(f"  {pkg.name} {pkg.version} ({pkg.licence}): {pkg.files} files, {pkg.bytes / 1e6:.1f} MB, dropped {pkg.dropped}")
    c.packages += [p for p, _ in dists if p.name in held]
    if not c.train:
        raise FileNotFoundError("no permissively licensed Python sources found")
    return c


def held_out_sources(held_out_packages: tuple[str, ...] = HELD_OUT_PACKAGES,
                     dirs: list[str] | None = None) -> dict[str, list[tuple[str, str]]]:
    """Only the held-out text, read cheaply (for benchmarks): {"packages": files of the held-out
    distributions that are installed here, "stdlib": the HELD_OUT stdlib modules}, each file
    through the same filter as the corpus."""
    import importlib.metadata as md

    from . import sources

    out: dict[str, list[tuple[str, str]]] = {"packages": [], "stdlib": []}
    held = {sources._norm_name(n) for n in held_out_packages}
    done: set[str] = set()
    for d in (sources.site_dirs() if dirs is None else dirs):
        for dist in sorted(md.distributions(path=[d]), key=lambda x: sources._norm_name(x.metadata["Name"] or "")):
            name = sources._norm_name(dist.metadata["Name"] or "")
            if name not in held or name in done:
                continue
            done.add(name)
            for f in sorted(str(x).replace(os.sep, "/") for x in dist.files or []):
                if f.endswith(".py") and not f.startswith(("../", "/")):
                    text, _ = sources.file_filter(f, sources.read(os.path.join(d, f)) or b"")
                    if text is not None:
                        out["packages"].append((f"{name}/{f}", text))
    root = stdlib_root()
    for rel in _py_files(root):
        if _held_out(rel):
            try:
                with open(os.path.join(root, rel), encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                out["stdlib"].append((rel, text))
    return out


def _path_hash(key: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little")


def _prefilter_cut(std_train, dists, max_files: int | None, max_bytes: int | None) -> int:
    """build_site_corpus reads only training files whose path hash lies below this: 2**32 (all),
    or a cut with room for subsample(max_bytes) after filtering and deduplication."""
    if not max_bytes:
        return 2**32
    size = sum(len(t.encode()) for _, t in std_train[:max_files])
    for _, files in dists:
        for _, path in files[:max_files]:
            try:
                size += os.path.getsize(path)
            except OSError:
                pass
    return 2**32 if size <= 1.3 * max_bytes else int(2**32 * 1.3 * max_bytes / size)


def subsample(docs: list[tuple[str, str]], max_bytes: int, ceiling: int = 2**32) -> list[tuple[str, str]]:
    """Docs whose stable path hash falls in the first max_bytes/total share: an even, deterministic
    sample across packages when the corpus is larger than the training budget can see. `ceiling`:
    the docs are already those with a hash below it (Corpus.hash_ceiling), so the share is of it."""
    total = sum(len(t.encode()) for _, t in docs)
    if total <= max_bytes:
        return docs
    cut = int(ceiling * max_bytes / total)
    return [(r, t) for r, t in docs if _path_hash(r) < cut]


def split_validation(docs: list[tuple[str, str]], permille: int,
                     salt: str = "ul-val") -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, validation): the docs whose salted path hash falls in the first `permille`/1000 go to
    validation (independent of subsample's unsalted hash, so the split is even across packages)."""
    val = [d for d in docs if _path_hash(salt + d[0]) % 1000 < permille]
    keep = {r for r, _ in val}
    return [d for d in docs if d[0] not in keep], val
