"""PyTorch references of the small ops: the MLP activation, partial NeoX rotary embedding, row
argmax and the greedy accept rule."""
from __future__ import annotations

import torch

from .. import lanes


def silu_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u in g's dtype (silu rounded to the dtype before the product, as eager PyTorch does)."""
    return lanes.silu(g) * u


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rotary_dim] in float32 for integer positions [T]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R] with R <= D (the first R dims of each head rotate, the rest pass)."""
    r = cos.shape[-1]
    xr, xp = x[..., :r], x[..., r:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = r // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] int64 (ties to the lowest id, as torch.argmax)."""
    return logits.argmax(-1)


def greedy_accept_ref(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [k+1, V], draft [k] -> (targets [k+1] int64, n: the leading drafts equal to their
    row's target, a 0-d int64 tensor); the step emits targets[0..n]."""
    t = logits.argmax(-1)
    match = t[:-1] == draft.to(t.device, torch.int64)
    return t, match.to(torch.int64).cumprod(0).sum()


def greedy_accept_many_ref(logits: torch.Tensor, ids: torch.Tensor, spans: list[tuple[int, int]]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy accept of every member of a packed verify: member j's rows are spans[j] = [a, b)
    of logits [T, V] and of its verify ids [T] (its last token, then its drafts; rows outside every
    span are not read) -> (targets [T], n [M]), each member's targets[a:b] and n[j] as
    greedy_accept_ref of its rows and drafts alone (targets elsewhere: unspecified)."""
    ts = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    ns = []
    for a, b in spans:
        t, n = greedy_accept_ref(logits[a:b], ids[a + 1:b])
        ts[a:b] = t
        ns.append(n.reshape(1))
    return ts, torch.cat(ns)
