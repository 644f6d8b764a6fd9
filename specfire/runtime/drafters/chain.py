"""The MTP draft chain, written once: run eagerly by the MTP drafter and captured into CUDA graphs
(runtime/graphs.py DraftGraphs); and the greedy picks it chains."""
from __future__ import annotations

from typing import Callable

import torch

from ...model.qwen35 import MtpHead, Segments, SequenceState
from ...kernels import head as head_fused
from ...params import SamplingParams
from ..sampling import Penalties, penalize_draft


def draft_chain(head: MtpHead, embed: Callable[[torch.Tensor], torch.Tensor],
                lm_logits: Callable[[torch.Tensor], torch.Tensor], state: SequenceState, toks: torch.Tensor,
                hidden: torch.Tensor, pos: int | torch.Tensor, k: int, feed: str,
                choose: Callable[[torch.Tensor], torch.Tensor], n: torch.Tensor | None = None,
                embed_weight: torch.Tensor | None = None, fused_pick: bool = False) -> torch.Tensor:
    """The MTP draft chain, written once: run eagerly, and captured into a CUDA graph (greedy)
    by runtime/graphs.py. Catch-up over the pending rows (hidden [m, H] at positions pos.., toks
    [m] the tokens after them), then k steps of `choose(logits [1, V]) -> [1]` each feeding the
    head its own output (`feed`) and its own draft. `pos` is an int, or a one-element device
    tensor under capture. `n` (device, [1]): chain from row n, not the last (the rows after it
    are a verify's rejected ones: their KV entries lie past row n and are rewritten before any
    step reads them, as a rejected draft's are). `embed_weight`: the table `embed` looks up, where
    the head may gather from it itself (one device: MtpHead's fused rows step, kernels/head).
    `fused_pick` (greedy argmax picks only, `choose` unused): each pick, its write into the drafts
    and the next position in one launch, and row n with its position in one
    (kernels/head pick / select): the same drafts in fewer launches.
    Returns the drafts [k], int64, on the device: no host read."""
    def run(tk: torch.Tensor, hid: torch.Tensor, p) -> tuple[torch.Tensor, torch.Tensor]:
        if embed_weight is not None:
            return head(None, hid, p, state, rows=True, ids=tk, embed_weight=embed_weight)
        return head(embed(tk), hid, p, state, rows=True)

    pre, post = run(toks, hidden, pos)
    if n is None:
        h_pre, h_post = pre[-1:], post[-1:]
        p = pos + (toks.shape[0] - 1)                                         # position of the last row
    elif fused_pick:
        h_pre, h_post, p = head_fused.select(pre, post, n, pos)
    else:
        h_pre, h_post = pre.index_select(0, n), post.index_select(0, n)
        p = pos + n
    if fused_pick:
        out = torch.empty(k, dtype=torch.long, device=h_post.device)
        for step in range(k):
            last = step + 1 == k
            tok, p = head_fused.pick(lm_logits(h_post), out, step, None if last else p)
            if last:
                break
            fed = h_post if feed == "post" else h_pre
            h_pre, h_post = run(tok, fed, p)
        return out
    drafts = []
    for step in range(k):
        tok = choose(lm_logits(h_post))                                       # [1]
        drafts.append(tok)
        if step + 1 == k:
            break
        p = p + 1
        fed = h_post if feed == "post" else h_pre
        h_pre, h_post = run(tok, fed, p)
    return torch.cat(drafts)


def packed_chain_after(head: MtpHead, lm_logits: Callable[[torch.Tensor], torch.Tensor],
                       embed: Callable[[torch.Tensor], torch.Tensor], embed_weight: torch.Tensor | None,
                       catch: Segments, step: Segments, step_pos: torch.Tensor, starts: torch.Tensor,
                       toks: torch.Tensor, hidden: torch.Tensor, n: torch.Tensor, k: int, feed: str) -> torch.Tensor:
    """The greedy chains after several sequences' verifies at once (`draft_chain` with `n`, each
    over its own head state), as runtime/graphs.py PackedChains captures it: `catch` is sequence
    i's catch-up over its verify's rows (rows catch.spans[i] of toks / hidden, first row at
    `starts[i]`, at its positions catch.pos0s), row n[i] (device) picked, then k argmax steps,
    every step one packed head forward over one row per sequence (`step`, at the positions
    `step_pos` holds, rewritten here before each step: a replay reads them on the device), each
    weight, the lm_head's included, read once for all of them. -> drafts [S, k] on the device."""
    def run(segs: Segments, tk: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if embed_weight is not None:
            return head.packed(None, hid, segs, ids=tk, embed_weight=embed_weight)
        return head.packed(embed(tk), hid, segs)

    pre, post = run(catch, toks, hidden)
    at = starts + n                                                              # each sequence's row n
    h_pre, h_post = pre.index_select(0, at), post.index_select(0, at)
    first = torch.cat([p.reshape(1) for p in catch.pos0s]) + n                   # position of row n
    drafts = []
    for j in range(k):
        tok = lm_logits(h_post).argmax(-1)                                       # [S]
        drafts.append(tok)
        if j + 1 == k:
            break
        step_pos.copy_(first + (j + 1))
        fed = h_post if feed == "post" else h_pre
        h_pre, h_post = run(step, tok, fed)
    return torch.stack(drafts, dim=1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def already_picked(tok: torch.Tensor) -> torch.Tensor:
    """The choice where the scorer returns the token itself (a trunk's sharded `draft_pick`)."""
    return tok


def penalized_argmax(pen: Penalties, sp: SamplingParams) -> Callable[[torch.Tensor], torch.Tensor]:
    """A greedy chain's pick that applies the request's penalties: step j takes the argmax of
    its logits penalised with the request's counts plus drafts 0..j-1 (`penalize_draft`), the
    counts the verify's row j uses. A fresh closure per chain (it keeps the chain's picks)."""
    picked: list[torch.Tensor] = []

    def choose(logits: torch.Tensor) -> torch.Tensor:
        tok = penalize_draft(logits, pen, sp, picked).argmax(-1)
        picked.append(tok)
        return tok
    return choose
