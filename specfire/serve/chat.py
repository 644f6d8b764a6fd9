"""Chat requests with tools and reasoning: the checks of
`tools` / `tool_choice`, the prompt through the checkpoint's template, and the AssistantOutput the
relay turns the generated text into.

tool_choice `required` and a named function are a grammar over the template's call form
(serve/toolgrammar.py) that the decoding step applies; a tool list the template cannot show the
model is refused (400). A grammar (the tools' or the request's structured output) starts where
`think_start` says: after the think block the prompt opened, after one the model may open itself,
or at the first token."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from .assistant import AssistantOutput
from .chat_options import ChatOptions
from .wire import RequestError

if TYPE_CHECKING:
    from ..api import LLM
    from ..grammar import GrammarSpec
    from ..params import SamplingParams

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


# ---- request fields -------------------------------------------------------------------------------

def parse_tools(v: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise RequestError("'tools' must be an array of {\"type\": \"function\", \"function\": {...}}", "tools")
    names = set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}", where)
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise RequestError(f"'{where}.function.name' must be 1-128 letters, digits, _ . : -, got {name!r}",
                               f"{where}.function.name")
        if name in names:
            raise RequestError(f"'{where}.function.name' {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise RequestError(f"'{where}.function.parameters' must be a JSON schema object",
                               f"{where}.function.parameters")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise RequestError(f"'{where}.function.description' must be a string", f"{where}.function.description")
    return v


def parse_tool_choice(v: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """(choice, function name): choice "auto", "none", "required" or "named" (the default: auto
    with tools, none without)."""
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("auto", "none"):
        return v, None
    if v == "required" or isinstance(v, dict):
        if not tools:
            raise RequestError(f"'tool_choice' {v if isinstance(v, str) else 'a named function'} needs 'tools'",
                               "tool_choice")
        if v == "required":
            return "required", None
        f = v.get("function")
        name = f.get("name") if v.get("type") == "function" and isinstance(f, dict) else None
        if not isinstance(name, str):
            raise RequestError("'tool_choice' must name a function as {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"'tool_choice.function.name' {name!r} is not one of 'tools'", "tool_choice.function.name")
        return "named", name
    raise RequestError(f"'tool_choice' must be \"auto\", \"none\", \"required\" or a named function, got {v!r}",
                       "tool_choice")


def think_start(gen: str | None, kwargs: dict[str, Any]) -> tuple[bool, bool]:
    """(in_think, may_think) from the generation prompt `gen` (None: no reasoning parser): the prompt
    opened a think block (the answer starts inside it, a grammar after its end), or neither opened
    nor closed one with thinking not turned off (the model may open one itself, as earlier Qwen3
    templates leave it; vLLM's Qwen3 parser then reads the reasoning as not ended, so a grammar
    waits for it)."""
    if gen is None:
        return False, False
    in_think = gen.rfind("<think>") > gen.rfind("</think>")
    may_think = "<think>" not in gen and "</think>" not in gen and kwargs.get("enable_thinking") is not False
    return in_think, may_think


@dataclass
class ChatPrep:
    """A chat body made ready: the prompt ids, a factory of its AssistantOutput, the tools' grammar
    (tool_choice required / named) and where any grammar starts: after `think_end` (a think block
    the prompt opened), after an optional think block the model writes (`may_think`), or at once."""

    ids: list[int]
    assistant: Callable[[], AssistantOutput]
    grammar: "GrammarSpec | None" = None
    think_end: str | None = None
    may_think: bool = False

    def params(self, sp: "SamplingParams") -> "SamplingParams":
        """`sp` with the request's one grammar (the tools' or the body's), placed after the think block."""
        g = sp.structured_outputs
        if self.grammar is not None:
            if g is not None:
                raise RequestError(f"'{g.param}' and 'tool_choice' both constrain the output; give one", g.param)
            g = self.grammar
        if g is None:
            return sp
        try:
            return dataclasses.replace(sp, structured_outputs=dataclasses.replace(g, after=self.think_end,
                                                                                  think=self.may_think))
        except ValueError as e:             # e.g. min_tokens with a grammar
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None


# ---- the prompt and the output parser ------------------------------------------------------------

def prepare_chat(llm: "LLM", messages: list[dict[str, Any]], extra: dict[str, Any], kwargs: dict[str, Any],
                 opts: ChatOptions) -> ChatPrep:
    """The prompt ids, the AssistantOutput factory and the grammars' place for a chat body;
    `extra`: the body's tools and tool_choice."""
    from jinja2 import TemplateError

    from ..chat_template import ChatInputError
    from ..errors import PromptError

    tok = llm.tokenizer
    if tok is None:
        raise RequestError("this model has no tokenizer, so it cannot serve chat; use /v1/completions with token "
                           "ids", "messages")
    tools = parse_tools(extra.get("tools"))
    choice, named = parse_tool_choice(extra.get("tool_choice"), tools)
    t = tok.template
    if tools and not t.renders_tools:
        raise RequestError("'tools': this model's chat template does not show tools to the model", "tools")
    try:
        ids = tok.chat_ids(messages, tools or None, True, kwargs, opts.allow_special_tokens_in_content)
        reasoning = opts.reasoning_parser == "qwen3" or (opts.reasoning_parser == "auto" and t.thinks)
        in_think, may_think = think_start(t.generation_prompt(messages, tools or None, kwargs) if reasoning else None,
                                          kwargs)
    except ChatInputError as e:
        raise RequestError(str(e), e.param) from None
    except (ValueError, TypeError, TemplateError, RecursionError) as e:
        raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           "messages") from None
    try:
        ids = llm.prompt_ids(ids)
    except PromptError as e:
        raise RequestError(f"'messages': {e}", "messages", code="context_length_exceeded" if e.too_long else None) \
            from None
    form = None
    if tools and choice != "none":
        form = (t.tool_call_form or "auto") if opts.tool_call_parser == "auto" else opts.tool_call_parser
    grammar = None
    if choice in ("required", "named"):
        assert tools is not None
        if form not in ("qwen3_xml", "qwen3_json"):
            raise RequestError("'tool_choice': this model's chat template teaches no tool-call form to enforce; pass "
                               "--tool-call-parser qwen3_xml or qwen3_json, or use \"auto\"", "tool_choice")
        from .toolgrammar import tool_grammar

        grammar = tool_grammar(tools, form, named, set(t.added))
    think_end = "</think>" if in_think and tok.tok.token_to_id("</think>") is not None else None
    schemas = {x["function"]["name"]: x["function"].get("parameters") or {} for x in tools or []}
    return ChatPrep(ids, partial(AssistantOutput, reasoning, in_think, form, schemas), grammar, think_end, may_think)
