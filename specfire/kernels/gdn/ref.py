"""PyTorch references of Gated DeltaNet: the causal conv window, the gates and q / k norms, the
recurrence row by row with its commit, and the chunked (WY) form for prefill (the math:
kernels/gdn/__init__.py). The one formulation: inference (layers/gdn.py) and training
(train/model.py, train/rollout.py) compute the layer with these functions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import lanes


def conv_window_ref(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU. x [..., T, C] inputs, window [..., K-1, C] previous inputs,
    w [C, K] (leading dimensions: a training batch).

    Returns (out [..., T, C] float32, full [..., K-1+T, C]); the window after row n is
    full[n+1 : n+K]. Each output is an explicit chain over the K taps, so a row's value never
    depends on T.
    """
    kk = w.shape[1]
    t = x.shape[-2]
    full = torch.cat([window.to(x.dtype), x], dim=-2)
    wf = w.float()
    acc = full[..., 0:t, :].float() * wf[:, 0]
    for j in range(1, kk):
        acc = acc + full[..., j:j + t, :].float() * wf[:, j]
    return lanes.silu(acc), full


def gates_ref(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-projections' b, a [..., Hv] -> (beta = sigmoid(b), log decay g = -exp(A_log)
    softplus(a + dt_bias)), float32."""
    beta = lanes.sigmoid(b.float())
    return beta, -lanes.exp(a_log.float()) * lanes.softplus(a.float() + dt_bias.float())


def l2norm_ref(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension, times `scale` (q: dk^-1/2)."""
    y = x * lanes.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
    return y if scale == 1.0 else y * scale


def update(s: torch.Tensor, dec: torch.Tensor, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """One row's state update S' = dec S + k delta^T, s [..., Hv, dk, dv], dec [..., Hv], k [..., Hv,
    dk], delta [..., Hv, dv]: three exactly rounded operations (no fused multiply-add), so the bits
    do not depend on how torch splits or batches the work: the CPU rows forwards apply it layer by
    layer and the CPU commit to every layer at once."""
    return s * dec[..., None, None] + k[..., :, None] * delta[..., None, :]


def gdn_rows_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, log: bool = False) -> tuple[torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Row-by-row recurrence. Returns (o [T, Hv, dv], final state [Hv, dk, dv]), or with `log`
    (o, (delta [T, Hv, dv], dec [T, Hv])): the update terms `commit_rows` replays. `state` is not
    modified."""
    s = state
    outs, deltas, decs = [], [], []
    for t in range(q.shape[0]):   # exp per row: a row's lanes then sit where a one-row decode's do
        dec = lanes.exp(g[t])
        u = torch.bmm(k[t].unsqueeze(1), s * dec[:, None, None]).squeeze(1)      # [Hv, dv]
        delta = beta[t][:, None] * (v[t] - u)
        s = update(s, dec, k[t], delta)                                         # [Hv, dk, dv]
        outs.append(torch.bmm(q[t].unsqueeze(1), s).squeeze(1))
        deltas.append(delta)
        decs.append(dec)
    o = torch.stack(outs)
    return o, ((torch.stack(deltas), torch.stack(decs)) if log else s)


def commit_rows_ref(states: torch.Tensor, k: torch.Tensor, delta: torch.Tensor, dec: torch.Tensor, rows: int) -> None:
    """Apply the first `rows` logged rows to the states in place: states [L, Hv, dk, dv] float32 (L
    layers), k [L, T, Hv, dk], delta [L, T, Hv, dv], dec [L, T, Hv] as a rows forward logged them.
    `update`'s operations, in place (the same bits; no temporary the size of every state per op)."""
    if not rows:
        return
    kd = torch.empty_like(states)
    for t in range(rows):
        states.mul_(dec[:, t, :, None, None])
        torch.mul(k[:, t, :, :, None], delta[:, t, :, None, :], out=kd)
        states.add_(kd)


@dataclass
class ChunkTerms:
    """The per-chunk terms of the chunked form, batched over every chunk ([H, N, C, ...])."""

    qb: torch.Tensor        # [H, N, C, dk]
    kb: torch.Tensor        # [H, N, C, dk]
    G: torch.Tensor         # [H, N, C] cumulative log decay within the chunk
    Wv: torch.Tensor        # [H, N, C, dv] (I + A)^-1 beta v
    Uk: torch.Tensor        # [H, N, C, dk] (I + A)^-1 beta exp(G) k
    QK: torch.Tensor        # [H, N, C, C]  (Q K^T) * decay, causal incl. the diagonal
    kdec: torch.Tensor      # [H, N, C, dk] k * exp(G_C - G)
    n: int
    t_len: int


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk: int) -> ChunkTerms:
    t_len = k.shape[0]
    pad = (-t_len) % chunk
    n = (t_len + pad) // chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [H, N, C, ...]
        x = torch.nn.functional.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.reshape(n, chunk, *x.shape[1:]).movedim(2, 0)

    qb, kb, vb = blocks(q), blocks(k), blocks(v)                    # [H, N, C, d]
    gb, bb = blocks(g), blocks(beta)                                # [H, N, C]
    G = gb.cumsum(-1)
    idx = torch.arange(chunk, device=q.device)
    incl = idx[:, None] >= idx[None, :]                             # s <= t
    D = lanes.exp((G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")))   # [H, N, C, C]
    A = (bb[..., :, None] * (kb @ kb.transpose(-1, -2)) * D).masked_fill(~(idx[:, None] > idx[None, :]), 0.0)
    L = A + torch.eye(chunk, device=q.device, dtype=torch.float32)  # unit lower triangular
    Wv = torch.linalg.solve_triangular(L, bb[..., None] * vb, upper=False, unitriangular=True)
    Uk = torch.linalg.solve_triangular(L, (bb * lanes.exp(G))[..., None] * kb, upper=False, unitriangular=True)
    QK = (qb @ kb.transpose(-1, -2)) * D
    kdec = kb * lanes.exp(G[..., -1:] - G)[..., None]
    return ChunkTerms(qb, kb, G, Wv, Uk, QK, kdec, n, t_len)


def gdn_chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form for prefill. Same contract as gdn_rows_ref without capture."""
    c = chunk_terms(q, k, v, g, beta, chunk)
    h, dv = c.Wv.shape[0], c.Wv.shape[-1]
    s = state
    outs = []
    for i in range(c.n):
        delta = c.Wv[:, i] - c.Uk[:, i] @ s                         # [H, C, dv]
        outs.append(lanes.exp(c.G[:, i])[..., None] * (c.qb[:, i] @ s) + c.QK[:, i] @ delta)
        s = lanes.exp(c.G[:, i, -1])[:, None, None] * s + c.kdec[:, i].transpose(-1, -2) @ delta
    o = torch.stack(outs, dim=1).reshape(h, c.n * chunk, dv)[:, :c.t_len].transpose(0, 1)
    return o.contiguous(), s
