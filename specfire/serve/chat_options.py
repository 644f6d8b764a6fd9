"""The serve flags that choose the chat parsers (no heavy imports: `specfire serve --help` reads them)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

TOOL_PARSERS = ("auto", "qwen3_xml", "qwen3_json")
REASONING_PARSERS = ("auto", "qwen3", "none")


@dataclass(frozen=True)
class ChatOptions:
    """`tool_call_parser`: the call form (auto: the one the template teaches). `reasoning_parser`:
    qwen3 splits <think> blocks out, none leaves them in content, auto: qwen3 where the template
    writes think blocks. `allow_special_tokens_in_content`: request text may spell control tokens."""

    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    allow_special_tokens_in_content: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSERS,
                   help="tool-call form in the output (default: the one the chat template teaches)")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                   help="split <think> blocks into reasoning_content (default: when the template writes them)")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="tokenize control tokens spelled inside messages (<|im_end|>) as control tokens")


def options_from(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions(args.tool_call_parser, args.reasoning_parser, args.allow_special_tokens_in_content)
