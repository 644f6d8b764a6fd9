"""An assistant answer as OpenAI shapes it: generated text in, reasoning / content / tool-call
deltas out while it streams, and the final message (with finish_reason "tool_calls" when the model
called one) at the end. The deltas of a stream concatenate to the final message, whatever pieces
the text came in.

Whitespace at the edges of the reasoning, and of content next to a tag (after `</think>` or a call,
before a call), is the template's layout, not the answer's: it is dropped (held back while
streaming until the next text shows which it is)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .reasoning import REASONING, ReasoningSplitter
from .toolcalls import IdFactory, ToolCallParser, new_call_id


class Trim:
    """A text segment with its leading whitespace dropped (when `lead`) and its trailing whitespace
    held until more text follows (`cut` drops it, `flush` releases it)."""

    def __init__(self, lead: bool):
        self.lead, self.held = lead, ""

    def push(self, s: str) -> str:
        if self.lead:
            s = s.lstrip()
            if not s:
                return ""
            self.lead = False
        s = self.held + s
        body = s.rstrip()
        self.held = s[len(body):]
        return body

    def cut(self) -> None:
        self.held, self.lead = "", True

    def flush(self) -> str:
        s, self.held = self.held, ""
        return s


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class AssistantOutput:
    """`reasoning`: split `<think>` blocks out (`in_think`: the prompt opened one). `tool_form`:
    parse tool calls of that form (None: none, all text is content). `tools`: name -> parameters schema."""

    reasoning: bool = False
    in_think: bool = False
    tool_form: str | None = None
    tools: dict[str, Any] | None = None
    new_id: IdFactory = new_call_id
    content: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.splitter = ReasoningSplitter(self.in_think) if self.reasoning else None
        self.parser = ToolCallParser(self.tool_form, self.tools) if self.tool_form else None
        self.think_trim, self.text_trim = Trim(True), Trim(False)

    # ---- streaming --------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """OpenAI delta objects for `text`, adjacent ones of one kind merged."""
        return self._deltas(self._split(text, final=False))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back, once the output is complete."""
        return self._deltas(self._split("", final=True))

    def _split(self, text: str, final: bool) -> list[tuple[str, str]]:
        parts = [("text", text)]
        if self.splitter is not None:
            parts = self.splitter.feed(text) + (self.splitter.finish() if final else [])
        events: list[tuple[str, str]] = []
        for kind, s in parts:
            if kind == REASONING:
                events.append(("reasoning", self.think_trim.push(s)))
            elif kind == "end_reasoning":
                self.think_trim.cut()
                self.text_trim.cut()
            elif self.parser is not None:
                events += self.parser.feed(s)
            else:
                events.append(("content", s))
        if final and self.parser is not None:
            events += self.parser.finish()
        out: list[tuple[str, str]] = []
        for kind, s in events:
            if kind == "content":
                out.append(("content", self.text_trim.push(s)))
            elif kind == "boundary":
                self.text_trim.cut()
            else:
                out.append((kind, s))
        if final:
            out.append(("content", self.text_trim.flush()))
        return out

    def _deltas(self, events: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        last = None                  # (kind, index) of out[-1], for merging
        for kind, s in events:
            if kind in ("reasoning", "content", "args") and not s:
                continue
            if kind == "reasoning":
                self.thoughts.append(s)
                if last == ("reasoning", None):
                    out[-1]["reasoning_content"] += s
                    out[-1]["reasoning"] += s
                else:
                    out.append({"reasoning_content": s, "reasoning": s})
                last = ("reasoning", None)
            elif kind == "content":
                self.content.append(s)
                if last == ("content", None):
                    out[-1]["content"] += s
                else:
                    out.append({"content": s})
                last = ("content", None)
            elif kind == "call":
                call = Call(self.new_id(), s)
                self.calls.append(call)
                i = len(self.calls) - 1
                out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                            "function": {"name": s, "arguments": ""}}]})
                last = ("call", i)
            elif kind == "args":
                i = len(self.calls) - 1
                self.calls[i].arguments += s
                if last == ("args", i):
                    out[-1]["tool_calls"][0]["function"]["arguments"] += s
                else:
                    out.append({"tool_calls": [{"index": i, "function": {"arguments": s}}]})
                last = ("args", i)
        return out

    # ---- the whole answer -------------------------------------------------------------------------
    def message(self) -> dict[str, Any]:
        """The final assistant message (call `finish` first): content null when there is none."""
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.reasoning:
            r = "".join(self.thoughts) or None
            msg["reasoning_content"] = msg["reasoning"] = r
        if self.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.calls]
        return msg

    def finish_reason(self, engine_reason: str) -> str:
        """The engine's reason, "tool_calls" where the model stopped after calling one."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason
