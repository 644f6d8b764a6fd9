"""Definition snippets: the exact source of each `def` / `class` block of a file, for the fine-tune
that teaches the model to END after the definition it completes (snippet_phase.run_snippet_phase).

Training documents are whole files, so after a definition the model only ever saw more of the file:
given a bare `def` / `class` prompt at the start of the text it writes one body and then starts the
same `def` again (MODEL_CARD.md). A snippet row holds definition blocks cut from the corpus, each
followed by the end-of-text token, the first one at position 0 with no context before it (how the
engine sees a prompt: no BOS token) and the others right after an end-of-text separator.

Blocks are cut with Python's own parser (`ast`): a block runs from its first decorator (or its
`def` / `class` line) to the last line of its last statement (`end_lineno`), so comments and blank
lines after it stay out. Classes are taken whole (their methods included); with `nested`, methods and
functions nested in other blocks are taken too, dedented to column 0 (skipped when a line of the
block is indented less than its `def`, e.g. inside a multi-line string). A file that does not parse
gives no block.
"""
from __future__ import annotations

import ast
import random

import torch

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _parse(text: str):
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _block(lines: list[str], node) -> tuple[int, int]:
    """0-based [start, end) line range of a def / class node, decorators included."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return start - 1, node.end_lineno


def _dedent(lines: list[str], col: int) -> list[str] | None:
    """The lines with exactly `col` leading characters of indentation removed; None when a non-blank
    line has less (its text is not part of the block's indentation: a multi-line string)."""
    if col == 0:
        return lines
    pre = lines[0][:col]
    if pre.strip() or len(pre) < col:
        return None
    out = []
    for ln in lines:
        if ln.startswith(pre):
            out.append(ln[col:])
        elif not ln.strip():
            out.append("")
        else:
            return None
    return out


def _norm(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")      # ast's line ends: the lines below


def _blocks(tree, lines: list[str], nested: bool) -> list[tuple[str, bool]]:
    """(block source, top level?) of every def / class of a parsed file, in file order."""
    out: list[tuple[str, bool]] = []

    def visit(body, top: bool) -> None:
        for node in body:
            if isinstance(node, _DEFS):
                a, b = _block(lines, node)
                blk = lines[a:b] if top else _dedent(lines[a:b], node.col_offset)
                if blk is not None and (top or nested):
                    out.append(("\n".join(blk).rstrip() + "\n", top))
                if nested:
                    visit(node.body, False)
            elif nested:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        visit(sub, False)

    visit(tree.body, True)
    return out


def _header(tree, lines: list[str], max_lines: int) -> str:
    out: list[str] = []
    for node in tree.body:
        if isinstance(node, _DEFS):
            break
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += lines[node.lineno - 1:node.end_lineno]
    return "\n".join(out[:max_lines]) + "\n" if out else ""


def definition_blocks(text: str, nested: bool = False) -> list[str]:
    """The source of every top-level `def` / `class` block of `text` (and, with `nested`, of every
    def / class inside them, dedented), in file order, each ending with one newline."""
    text = _norm(text)
    tree = _parse(text)
    return [] if tree is None else [b for b, _ in _blocks(tree, text.split("\n"), nested)]


def import_header(text: str, max_lines: int = 6) -> str:
    """The file's top-level `import` / `from` statements before its first definition (at most
    max_lines lines of them, exact source), or "" when it has none."""
    text = _norm(text)
    tree = _parse(text)
    return "" if tree is None else _header(tree, text.split("\n"), max_lines)


def _file_snippets(job: tuple[int, str, bool, int, float, int]) -> list[str]:
    i, text, nested, max_chars, import_frac, seed = job
    text = _norm(text)
    tree = _parse(text)
    if tree is None:
        return []
    lines = text.split("\n")
    head = _header(tree, lines, 6) if import_frac else ""
    rng = random.Random(seed * 1_000_003 + i)
    return [head + "\n\n" + b if head and top and rng.random() < import_frac else b
            for b, top in _blocks(tree, lines, nested) if len(b) <= max_chars]


def corpus_blocks(docs: list[tuple[str, str]], nested: bool = False, max_chars: int = 6000,
                  import_frac: float = 0.0, seed: int = 0, workers: int = 0) -> list[str]:
    """Every definition block of the documents (definition_blocks) of at most max_chars characters;
    an `import_frac` share (seeded per file) of the top-level blocks of files that import something
    come after that file's import_header and two blank lines (a snippet that shows its imports).
    `workers` > 1 parses the files in that many processes (same result)."""
    jobs = [(i, text, nested, max_chars, import_frac, seed) for i, (_, text) in enumerate(docs)]
    if workers > 1 and len(jobs) > 64:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_file_snippets, jobs, chunksize=16)
    else:
        parts = [_file_snippets(j) for j in jobs]
    return [b for p in parts for b in p]


def definition_prompts(docs: list[tuple[str, str]], n: int, seed: int, tok, max_tokens: int = 48,
                       max_lines: int = 4) -> list[list[int]]:
    """n prompts shaped like a user's: the first k lines (k drawn from 1..max_lines, at least two lines
    of the block left after them) of top-level def / class blocks of the documents, from position 0,
    of at most max_tokens tokens; blocks in a seeded order, one prompt per block."""
    blocks = [b for _, text in docs for b in definition_blocks(text)]
    rng = random.Random(seed)
    rng.shuffle(blocks)
    out: list[list[int]] = []
    for b in blocks:
        if len(out) == n:
            break
        lines = b.split("\n")[:-1]
        k = rng.randint(1, max_lines)
        if len(lines) < k + 2:
            continue
        ids = tok.encode("\n".join(lines[:k]) + "\n", add_special_tokens=False).ids
        if 0 < len(ids) <= max_tokens:
            out.append(ids)
    return out


class SnippetRows:
    """Training rows of definition snippets: tokenized blocks, each + end-of-text, packed from
    position 0 (a random block first, then random blocks after the separators) and cut at `length`
    tokens. A `blank_frac` share of the blocks (seeded) end with two blank lines before end-of-text
    (where whole files go on with the next definition), the rest with their last line's newline (as a
    file ends). Blocks of `length` tokens or more are dropped (each kept one can end in a row)."""

    def __init__(self, tok, blocks: list[str], eot: int, length: int, seed: int, blank_frac: float = 0.0):
        self.rng = random.Random(seed)
        texts = [b + "\n\n" if self.rng.random() < blank_frac else b for b in blocks]
        enc = getattr(tok, "encode_batch_fast", tok.encode_batch)(texts, add_special_tokens=False) if texts else []
        self.seqs = [e.ids + [eot] for e in enc if 0 < len(e.ids) < length]
        if not self.seqs:
            raise ValueError(f"no definition block of fewer than {length} tokens to build snippet rows from")
        self.length = length

    def row(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.length:
            out += self.seqs[self.rng.randrange(len(self.seqs))]
        return out[:self.length]

    def batch(self, n: int, device) -> torch.Tensor:
        return torch.tensor([self.row() for _ in range(n)], dtype=torch.long, device=device)

    def summary(self) -> dict:
        lens = sorted(len(s) for s in self.seqs)
        return {"blocks": len(lens), "tokens": sum(lens), "median_tokens": lens[len(lens) // 2]}
