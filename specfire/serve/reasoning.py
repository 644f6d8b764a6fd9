"""Incremental split of a Qwen3 answer into reasoning (`<think>...</think>`) and the rest.

Fed text in any pieces, it gives the same split as fed all at once: text that might be the start
of a tag is held until the next piece decides it. The template may open the think block in the
prompt (Qwen3.5 / 3.6 end the generation prompt with `<think>\\n`), so the answer can start inside
it; otherwise a `<think>` opening the answer (after whitespace) starts one."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING, TEXT = "reasoning", "text"


def held_prefix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


class ReasoningSplitter:
    """feed(text) / finish() -> [(REASONING | TEXT | "end_reasoning", text)]; "end_reasoning" marks `</think>`."""

    def __init__(self, in_think: bool):
        self.state = "think" if in_think else "start"
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "think"
                elif OPEN.startswith(head):      # whitespace or part of the tag so far: wait
                    break
                else:
                    self.state = "text"
            elif self.state == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    out += [(REASONING, self.buf[:i]), ("end_reasoning", "")]
                    self.buf, self.state = self.buf[i + len(CLOSE):], "text"
                    continue
                keep = held_prefix(self.buf, (CLOSE,))
                out.append((REASONING, self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                out.append((TEXT, self.buf))
                self.buf = ""
        return [(k, s) for k, s in out if s or k == "end_reasoning"]

    def finish(self) -> list[tuple[str, str]]:
        """The held tail: reasoning cut off before `</think>` stays reasoning; anything else is text."""
        buf, self.buf = self.buf, ""
        if not buf:
            return []
        return [(REASONING if self.state == "think" else TEXT, buf)]
