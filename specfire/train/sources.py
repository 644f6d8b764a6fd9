"""Python sources by installed distribution, with their licences, filtered and deduplicated.

The bundled model's corpus is the `.py` files that this interpreter's site-packages hold, grouped
by the distribution whose RECORD lists them (files no distribution claims are skipped: their
provenance is unknown), kept only for distributions whose licence metadata is permissive
(licences.py), plus the standard library (PSF-2.0). Vendored third-party trees and generated or
data-like files are dropped, and near-duplicate files (transformers copies model code from file to
file) are kept once: a file most of whose substantive lines already occurred is a copy.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import platform
import re
import sys
from dataclasses import dataclass, field

from .licences import classify

VENDORED_DIRS = frozenset({"_vendor", "vendor", "vendored", "_vendored", "third_party", "_third_party",
                           "extern", "_extern", "__pycache__"})
MAX_FILE_BYTES = 400_000        # larger .py files are generated tables, not code to learn from
MAX_LINE_CHARS = 1000           # a longer line marks data (embedded blobs, unicode tables)
MIN_LINE_CHARS = 16             # shorter lines (`return x`, `else:`) say nothing about copying
NEAR_DUP_FRAC = 0.5             # a file with this share of already-seen substantive lines is a copy
NEAR_DUP_MIN_LINES = 10         # smaller files are only deduplicated exactly
STDLIB = "python-stdlib"
NEVER = frozenset({"specfire"})  # this project's own code is not training data


@dataclass
class Package:
    """One distribution's provenance record (what the model card and ATTRIBUTION.md list)."""
    name: str
    version: str
    licence: str
    licence_source: str
    permissive: bool
    role: str = "train"                 # train | held_out | refused
    files: int = 0                      # files kept
    bytes: int = 0                      # bytes kept
    dropped: dict = field(default_factory=dict)   # reason -> files

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def site_dirs() -> list[str]:
    """site-packages / dist-packages directories on sys.path, in import order."""
    out = []
    for p in sys.path:
        if p and os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages") and os.path.isdir(p):
            rp = os.path.realpath(p)
            if rp not in out:
                out.append(rp)
    return out


def _norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _licence_texts(dist) -> list[str]:
    texts = []
    for f in dist.files or []:
        base = os.path.basename(str(f)).upper()
        if base.startswith(("LICENSE", "LICENCE", "COPYING")):
            try:
                texts.append(dist.locate_file(f).read_text(encoding="utf-8", errors="replace")[:20000])
            except OSError:
                pass
    return texts


def distributions(dirs: list[str] | None = None) -> list[tuple[Package, list[tuple[str, str]]]]:
    """Every distribution installed in `dirs` (first occurrence of a name wins, as for imports), with
    its licence and its `.py` files as (relative path inside the site dir, absolute path)."""
    dirs = dirs if dirs is not None else site_dirs()
    seen: set[str] = set()
    out = []
    for d in dirs:
        for dist in sorted(md.distributions(path=[d]), key=lambda x: _norm_name(x.metadata["Name"] or "")):
            name = _norm_name(dist.metadata["Name"] or "")
            if not name or name in seen or name in NEVER:
                continue
            seen.add(name)
            lic = classify(dist.metadata, _licence_texts(dist))
            pkg = Package(name, dist.version, lic.name, lic.source, lic.permissive,
                          role="train" if lic.permissive else "refused")
            files = []
            for f in dist.files or []:
                rel = str(f).replace(os.sep, "/")
                if not rel.endswith(".py") or rel.startswith(("../", "/")):
                    continue
                files.append((rel, os.path.join(d, rel)))
            out.append((pkg, sorted(files)))
    return out


def file_filter(rel: str, data: bytes) -> tuple[str | None, str]:
    """(text, "") for a file worth training on, else (None, reason)."""
    parts = rel.split("/")
    if any(p in VENDORED_DIRS for p in parts[:-1]):
        return None, "vendored"
    if len(data) > MAX_FILE_BYTES:
        return None, "too_large"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not_utf8"
    if not text.strip():
        return None, "empty"
    if max(map(len, text.splitlines()), default=0) > MAX_LINE_CHARS:
        return None, "data_like"
    return text, ""


def _line_keys(text: str) -> list[int]:
    return [hash(s) for s in (ln.strip() for ln in text.splitlines()) if len(s) >= MIN_LINE_CHARS]


class Deduper:
    """Exact duplicates by normalised text hash; near duplicates by line containment against
    everything kept so far (order decides which copy survives)."""

    def __init__(self) -> None:
        self.exact: set[bytes] = set()
        self.lines: set[int] = set()

    def seen(self, text: str) -> str:
        """'' if new (and remember it), else 'exact_dup' / 'near_dup'."""
        norm = "\n".join(ln.rstrip() for ln in text.strip().splitlines())
        h = hashlib.blake2b(norm.encode(), digest_size=16).digest()
        if h in self.exact:
            return "exact_dup"
        keys = _line_keys(text)
        if len(keys) >= NEAR_DUP_MIN_LINES and sum(k in self.lines for k in keys) >= NEAR_DUP_FRAC * len(keys):
            return "near_dup"
        self.exact.add(h)
        self.lines.update(keys)
        return ""

    def overlap(self, text: str) -> float:
        keys = _line_keys(text)
        return sum(k in self.lines for k in keys) / len(keys) if len(keys) >= NEAR_DUP_MIN_LINES else 0.0


def stdlib_package() -> Package:
    return Package(STDLIB, platform.python_version(), "PSF-2.0", "python", True)


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None
