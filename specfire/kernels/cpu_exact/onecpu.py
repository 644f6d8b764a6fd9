"""One CPU device's norms and GDN gates: fused torch calls where no tensor-parallel shard has to be matched.

Outside an invariant() scope (kernels/cpu_exact/lanes.py: a mesh rank, or the canonical mode of kernels/splitk)
one CPU device needs only row invariance (a verify row equals a one-row decode), which per-row
application (kernels/cpu_exact/rowwise.py) gives to any formulation. So the norms use torch's rms_norm on a
cached (1 + w) instead of the reference's chain of seven calls (measured on the 2-core CPU,
[1, 256] float32: 18 us vs 55 us per norm; ~40 norms per decode step of the bundled model).
The bits differ from the reference's in the last place; the canonical mode keeps the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cached(w: torch.Tensor, tag: str, fn) -> torch.Tensor:
    """fn(w), kept on w (attribute `tag`) until w changes."""
    hit = getattr(w, tag, None)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    out = fn(w)
    if not w.is_inference():
        setattr(w, tag, (w._version, out))
    return out


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    """1 + w in float32 (zero-centred scale)."""
    return cached(w, "_specfire_p1", lambda t: 1.0 + t.float())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm in float32, cast back (contract of norm.rms_norm_ref)."""
    return F.rms_norm(x.float(), (x.shape[-1],), _plus_one(w), eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)), h rounded to x's dtype first (contract of norm.add_rms_norm_ref)."""
    s = x + h.to(x.dtype)
    return s, rms_norm(s, w, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm (contract of norm.gated_rms_norm_ref): plain w, then the SiLU gate."""
    dt = x.dtype
    if dt == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w.float(), eps) * F.silu(z.float())
    n = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dt)
    return ((w * n).float() * F.silu(z.float())).to(dt)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's beta = sigmoid(b) and log decay g = -exp(A_log) softplus(a + dt_bias),
    with -exp(A_log) computed once per weight."""
    neg_a = cached(a_log, "_specfire_nega", lambda t: -torch.exp(t.float()))
    return torch.sigmoid(b.float()), neg_a * F.softplus(a.float() + dt_bias.float())


def l2norm_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2-normalised q (scaled by dk^-1/2) and k of Gated DeltaNet in two calls:
    x rsqrt(sum x^2 + 1e-6) is rms_norm with eps 1e-6/dk times dk^-1/2, folded into its weight."""
    dk = q.shape[-1]
    wq = _const(dk, 1.0 / dk)
    wk = _const(dk, dk ** -0.5)
    eps = 1e-6 / dk
    return F.rms_norm(q, (dk,), wq, eps), F.rms_norm(k, (dk,), wk, eps)


_CONSTS: dict[tuple[int, float], torch.Tensor] = {}


def _const(n: int, v: float) -> torch.Tensor:
    """A float32 CPU vector of n copies of v (made once)."""
    t = _CONSTS.get((n, v))
    if t is None:
        t = _CONSTS[(n, v)] = torch.full((n,), v, dtype=torch.float32)
    return t
