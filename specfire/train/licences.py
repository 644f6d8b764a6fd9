"""Decide from an installed distribution's metadata whether its licence is permissive.

Only permissively licensed code goes into the bundled model's corpus. The decision reads, in order:
the PEP 639 `License-Expression` (an SPDX expression), the free-text `License` field, the
`License ::` classifiers, and last the text of the licence files the distribution ships. Anything
copyleft (GPL, LGPL, MPL, EPL, ...) or unrecognised is refused: being wrong costs a file, not a
licence breach.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# SPDX identifiers accepted as permissive (compared upper-case).
PERMISSIVE_SPDX = frozenset(s.upper() for s in (
    "MIT", "MIT-0", "MIT-CMU", "X11", "BSD-2-Clause", "BSD-3-Clause", "BSD-3-Clause-Clear", "0BSD",
    "Apache-2.0", "PSF-2.0", "Python-2.0", "Python-2.0.1", "CNRI-Python", "ISC", "Unlicense", "Zlib",
    "HPND", "CC0-1.0", "BSL-1.0", "NCSA", "UPL-1.0", "BlueOak-1.0.0"))
# SPDX exceptions that keep a permissive licence permissive
PERMISSIVE_EXCEPTIONS = frozenset({"LLVM-EXCEPTION"})
# Free-text licence names (the `License` field, lower-case, punctuation squeezed) -> SPDX-like name.
FREE_TEXT = (
    (r"^(the )?mit( license)?$|^mit/x11$|^expat$", "MIT"),
    (r"^(new |modified |revised )?bsd( license)?$|^bsd[- ]?3[- ]?clause( license)?$|^3[- ]clause bsd( license)?$"
     r"|^bsd 3-clause \"new\" or \"revised\" license$", "BSD-3-Clause"),
    (r"^(simplified )?bsd[- ]?2[- ]?clause( license)?$|^2[- ]clause bsd( license)?$", "BSD-2-Clause"),
    (r"^apache( software)?( license)?,?( version)? ?2(\.0)?( license)?$|^apache-2\.0$|^asl 2(\.0)?$", "Apache-2.0"),
    (r"^(psf|python software foundation)( license)?( version 2)?$|^psf-2\.0$", "PSF-2.0"),
    (r"^isc( license)?( \(iscl\))?$", "ISC"),
    (r"^(the )?unlicense$", "Unlicense"),
    (r"^zlib(/libpng)?( license)?$", "Zlib"),
    (r"^hpnd$", "HPND"),
    (r"^cc0( 1\.0)?( universal)?$", "CC0-1.0"),
    (r"^boost software license( 1\.0)?$|^bsl-1\.0$", "BSL-1.0"),
)
PERMISSIVE_CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
    "License :: OSI Approved :: The Unlicense (Unlicense)": "Unlicense",
    "License :: OSI Approved :: zlib/libpng License": "Zlib",
    "License :: OSI Approved :: Historical Permission Notice and Disclaimer (HPND)": "HPND",
    "License :: OSI Approved :: Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "License :: CC0 1.0 Universal (CC0 1.0) Public Domain Dedication": "CC0-1.0",
}
COPYLEFT = re.compile(r"\b(a?gpl|lgpl|mpl|epl|cddl|eupl|copyleft|gnu|mozilla|eclipse|affero|osl|cecill)\b", re.I)
# licence-file texts: (pattern, name); a copyleft marker anywhere refuses the file
LICENSE_TEXTS = (
    (r"Permission is hereby granted, free of charge", "MIT"),
    (r"Redistribution and use in source and binary forms", "BSD"),
    (r"Apache License\s+Version 2\.0", "Apache-2.0"),
    (r"PYTHON SOFTWARE FOUNDATION LICENSE", "PSF-2.0"),
    (r"Permission to use, copy, modify, and(/or)? distribute this software for any", "ISC"),
    (r"This is free and unencumbered software released into the public domain", "Unlicense"),
)


@dataclass(frozen=True)
class Licence:
    permissive: bool
    name: str          # the licence string as recorded in the model card (SPDX-like when known)
    source: str        # where it was read: expression | license | classifiers | file | none


def spdx_permissive(expr: str) -> bool:
    """Evaluate an SPDX expression: OR needs one permissive side, AND needs both, WITH keeps the
    licence only for a known permissive exception. Malformed expressions are refused."""
    toks = re.findall(r"\(|\)|[A-Za-z0-9.+\-]+", expr)
    pos = 0

    def peek() -> str | None:
        return toks[pos].upper() if pos < len(toks) else None

    def factor() -> bool:
        nonlocal pos
        t = peek()
        if t is None or t in (")", "AND", "OR", "WITH"):
            raise ValueError(expr)
        pos += 1
        if t == "(":
            v = disj()
            if peek() != ")":
                raise ValueError(expr)
            pos += 1
        else:
            v = t.rstrip("+") in PERMISSIVE_SPDX
        if peek() == "WITH":
            pos += 1
            exc = peek()
            if exc is None:
                raise ValueError(expr)
            pos += 1
            v = v and exc in PERMISSIVE_EXCEPTIONS
        return v

    def conj() -> bool:
        nonlocal pos
        v = factor()
        while peek() == "AND":
            pos += 1
            v = factor() and v
        return v

    def disj() -> bool:
        nonlocal pos
        v = conj()
        while peek() == "OR":
            pos += 1
            v = conj() or v
        return v

    try:
        v = disj()
        return v and pos == len(toks)
    except ValueError:
        return False


def free_text_licence(text: str) -> str | None:
    """The SPDX-like name of a short free-text `License` field, or None if not recognised."""
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    key = re.sub(r"\s+", " ", first.lower().replace("licence", "license")).strip(" .")
    for pat, name in FREE_TEXT:
        if re.search(pat, key):
            return name
    if spdx_permissive(first):                       # e.g. "MIT OR Apache-2.0" written in License
        return first
    return None


def classify(metadata, licence_texts: list[str] = ()) -> Licence:
    """Licence of a distribution from its metadata (an email.message-like object with get/get_all)
    and the texts of its licence files."""
    classifiers = [c for c in (metadata.get_all("Classifier") or []) if c.startswith("License ::")]
    expr = (metadata.get("License-Expression") or "").strip()
    if expr:
        return Licence(spdx_permissive(expr), expr, "expression")
    field = (metadata.get("License") or "").strip()
    bad_cls = [c for c in classifiers if COPYLEFT.search(c)]
    if field and field.upper() not in ("UNKNOWN", "NONE"):
        name = free_text_licence(field)
        first = next(ln.strip() for ln in field.splitlines() if ln.strip())
        if name is None and len(field) > 200 and not COPYLEFT.search(field[:4000]):
            name = next((n for pat, n in LICENSE_TEXTS if re.search(pat, field)), None)
        if name is not None and not bad_cls:
            return Licence(True, name, "license")
        if COPYLEFT.search(first) or bad_cls:
            return Licence(False, first[:80], "license")
    if classifiers:
        names = [PERMISSIVE_CLASSIFIERS.get(c) for c in classifiers]
        if all(names):
            return Licence(True, " / ".join(dict.fromkeys(names)), "classifiers")
        return Licence(False, "; ".join(c.split(" :: ")[-1] for c in classifiers), "classifiers")
    for text in licence_texts:
        if COPYLEFT.search(text[:4000]) and "GNU" in text[:4000].upper():
            return Licence(False, "copyleft licence file", "file")
        for pat, name in LICENSE_TEXTS:
            if re.search(pat, text):
                return Licence(True, name, "file")
    return Licence(False, field.splitlines()[0][:80] if field else "unknown", "none")
