"""The generation loop: prefill, then the shared speculative step until the output is done."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..config import SamplingParams, SpecPolicy
from ..tokenizer import Tokenizer
from .drafters import Drafter
from .output import OutputBuilder
from .route import select_route
from .sampling import pick
from .spec import OnCycle, SpecStats, spec_step
from .trunk import Trunk


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                       # "stop" | "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamChunk:
    """One streamed piece: new text and the token ids behind it; `result` is set on the last chunk."""

    text: str
    token_ids: list[int]
    result: GenerationResult | None = None


class Engine:
    """Token ids in, token ids (and text) out, over one trunk and optional drafters."""

    def __init__(self, trunk: Trunk, tokenizer: Tokenizer | None, eos_ids: set[int],
                 drafters: dict[str, Drafter], topology: str = "single"):
        self.trunk = trunk
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.topology = topology                # a label in route reasons; every topology serves every drafter
        self.drafters = drafters                # route name -> drafter ("mtp", "ngram")

    @property
    def mtp_loaded(self) -> bool:
        return "mtp" in self.drafters

    @property
    def max_seq(self) -> int:
        """Prompt plus generated tokens must fit in this many positions."""
        return self.trunk.max_seq

    def route(self, policy: SpecPolicy, sp: SamplingParams) -> tuple[str, str]:
        """(route, reason) a request would take; raises SpecfireError for a mode it cannot serve."""
        return select_route(policy, self.mtp_loaded, sp, self.topology)

    def check_prompt(self, ids: list[int]) -> None:
        vocab = self.trunk.cfg.vocab_size
        if len(ids) == 0:
            raise ValueError("prompt is empty: give at least one token")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool):
                raise ValueError(f"prompt token id {i!r} is not an integer")
            if not 0 <= i < vocab:
                raise ValueError(f"prompt token id {i!r} is out of range [0, {vocab})")
        if len(ids) >= self.trunk.max_seq:
            raise ValueError(f"prompt has {len(ids)} tokens; max_seq_len is {self.trunk.max_seq} "
                             f"(room for at least one generated token is needed)")

    def stream(self, ids: list[int], sp: SamplingParams, policy: SpecPolicy, on_cycle: OnCycle | None = None,
               drafter: Drafter | None = None) -> Iterator[StreamChunk]:
        """Generate from `ids`. `on_cycle(k, n, emitted)` is called after every step; `drafter`,
        when given, serves the request instead of the routed one (tests script drafts with it)."""
        self.check_prompt(ids)
        if drafter is not None:
            route, reason = drafter.name, f"drafter {drafter.name!r} given by the caller (k={policy.k})"
        else:
            route, reason = self.route(policy, sp)
            drafter = None if route == "ar" else self.drafters[route]
        k = policy.k if drafter is not None else 0
        dev = self.trunk.device
        gen = None
        if sp.seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(sp.seed)
        max_new = min(sp.max_tokens, self.trunk.max_seq - len(ids))
        out = OutputBuilder(sp, self.eos_ids, self.tokenizer, max_new)
        stats = SpecStats(on_cycle=on_cycle)

        t0 = time.perf_counter()
        prompt = torch.tensor(ids, device=dev)
        self.trunk.begin()
        rows = self.trunk.prefill(prompt)
        if drafter is not None:
            drafter.begin(prompt, rows.hidden)
        last = int(pick(rows.logits[-1:], sp, gen))
        t1 = time.perf_counter()
        pos = len(ids)
        emitted = [last]
        while True:
            n_before = len(out.token_ids)
            text = "".join(out.add(t) for t in emitted if not out.done)
            if text or len(out.token_ids) > n_before:
                chunk = StreamChunk(text, out.token_ids[n_before:])
                if not out.done:
                    yield chunk
            if out.done:
                break
            k_eff = max(0, min(k, out.remaining - 1, self.trunk.max_seq - pos - 1))
            emitted = spec_step(self.trunk, drafter, last, pos, k_eff, sp, gen, stats)
            pos += len(emitted)
            last = emitted[-1]
        t2 = time.perf_counter()
        n_gen = len(out.token_ids)
        prefill_s, decode_s = t1 - t0, t2 - t1
        st = {
            "prompt_tokens": len(ids), "generated_tokens": n_gen, "route": route, "route_reason": reason,
            "k": k, "cycles": stats.cycles, "drafted": stats.drafted, "accepted": stats.accepted,
            "mean_accept_len": stats.mean_accept_len, "accept_per_pos": stats.accept_per_pos,
            "accepted_per_pos": list(stats.accepted_per_pos),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_tok_s": len(ids) / prefill_s if prefill_s > 0 else 0.0,
            "decode_tok_s": (n_gen - 1) / decode_s if decode_s > 0 and n_gen > 1 else 0.0,
        }
        res = GenerationResult(out.text, list(out.token_ids), out.finish_reason or "length", list(ids), st)
        yield StreamChunk(text, out.token_ids[n_before:], res)
