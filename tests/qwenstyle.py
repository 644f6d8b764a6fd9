"""Tiny checkpoints with Qwen-style chat templates written here: think blocks, tools in the system
prompt, assistant tool calls, tool results as <tool_response>. Two call forms: `xml` (as Qwen3.5 /
3.6 teach: <function=NAME><parameter=KEY>) and `json` (as earlier Qwen templates: a JSON object in
<tool_call>). The tokenizer is tests/ckpts.py's with the think / tool tags as added, non-special
tokens (as Qwen's tokenizers have them)."""
from __future__ import annotations

import json
import os

from ckpts import build_tokenizer
from tinymodels import make_checkpoint

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_HEAD = r"""
{%- macro text(c) -%}
{%- if c is string -%}{{ c }}
{%- elif c is iterable and c is not mapping -%}{%- for p in c -%}{%- if p is mapping and p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}
{%- elif c is not none -%}{{ raise_exception('message content must be text') }}
{%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is not defined or enable_thinking -%}
{%- set keep_reasoning = preserve_thinking is defined and preserve_thinking -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}
{{- '# Tools\n\nThese functions are available to you:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\n' + INSTRUCTIONS + '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('the system message must come first') }}{%- endif %}
{%- elif m.role == 'user' %}
{{- '<|im_start|>user\n' + text(m.content) + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = text(m.content) %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if (keep_reasoning or loop.index0 > ns.last_user) and reasoning.strip() %}
{{- '<think>\n' + reasoning.strip() + '\n</think>\n\n' }}
{%- endif %}
{{- content.strip() }}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}
{%- if not loop.first or content.strip() %}{{- '\n' }}{%- endif %}
CALL
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + text(m.content) + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- raise_exception('unexpected message role') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
GENERATION
{%- endif %}
"""

XML_INSTRUCTIONS = ("To call a function, reply with this and nothing after it:\n<tool_call>\n<function=NAME>\n"
                    "<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>\nUse one <tool_call> block per "
                    "call; calls may follow one another. Give every required parameter.")
XML_CALL = r"""{{- '<tool_call>\n<function=' + f.name + '>\n' }}
{%- for k, v in (f.arguments or {}) | items %}
{{- '<parameter=' + k + '>\n' + (v if v is string else v | tojson) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}"""
JSON_INSTRUCTIONS = ("For each function call, return a JSON object with the function name and arguments in "
                     "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                     "<args-json-object>}\n</tool_call>")
JSON_CALL = r"""{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' + (f.arguments | tojson) + '}\n</tool_call>' }}"""
# Qwen3.5 / 3.6 open the think block in the prompt; earlier Qwen3 templates close an empty one only
# when thinking is off
XML_GENERATION = r"""{%- if thinking %}{{- '<think>\n' }}{%- else %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"""
JSON_GENERATION = r"""{%- if not thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"""


def template(form: str = "xml") -> str:
    instructions, call, gen = {"xml": (XML_INSTRUCTIONS, XML_CALL, XML_GENERATION),
                               "json": (JSON_INSTRUCTIONS, JSON_CALL, JSON_GENERATION)}[form]
    return (_HEAD.replace("INSTRUCTIONS", repr(instructions).replace("\\'", "'")).replace("CALL", call, 1)
            .replace("GENERATION", gen).strip() + "\n")


def build_qwen_tokenizer():
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return tok


def make_qwen_checkpoint(path: str, form: str = "xml", jinja_file: bool = True, seed: int = 0,
                         mtp: bool = True) -> str:
    """A tiny random model with the Qwen-style tokenizer and template (in chat_template.jinja, as
    Qwen3.5 ships it, or in tokenizer_config.json). Returns `path`."""
    os.makedirs(path, exist_ok=True)
    tok = build_qwen_tokenizer()
    make_checkpoint(path, "base", mtp=mtp, seed=seed, vocab_size=tok.get_vocab_size(with_added_tokens=True))
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if jinja_file:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template(form))
    else:
        cfg["chat_template"] = template(form)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return path


def qwen_ckpt(cache: dict, form: str = "xml") -> str:
    """Session-cached `make_qwen_checkpoint` of `form`."""
    key = ("qwenstyle", form)
    if key not in cache["made"]:
        cache["made"][key] = make_qwen_checkpoint(str(cache["root"] / f"qwenstyle_{form}"), form)
    return cache["made"][key]
