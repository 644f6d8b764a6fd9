"""The Gated DeltaNet prefill on the GPU at a shape's GDN geometry: the conv window over [T,
conv_dim] and the chunked form, the Triton passes (kernels/gdn/prefill.py) against the previous
path (PyTorch chunk terms with repeated key heads + the chunk scan kernel, and a conv kernel of one
program per channel block) and the float32 reference; ms per layer.

    python -m bench.gdn_prefill --check            (27B geometry, T = 1024 and 8192)

--check first: output and state errors of both paths against gdn_chunked_ref, and the value heads
of one tensor-parallel half computed alone == the same heads among all, bit for bit.
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.common import model_config
from specfire.kernels import gdn as G
from specfire.kernels._triton import tl, triton
from specfire.kernels.gdn.kernel import conv_window_triton
from specfire.kernels.gdn.prefill import gdn_prefill_triton


@triton.jit
def _conv_rows_in_order(full_ptr, w_ptr, out_ptr, n_rows, n_ch, K: tl.constexpr, BLOCK_C: tl.constexpr):
    """The previous conv kernel (the baseline): one program per channel block, rows in order."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < n_ch
    for t in range(n_rows):
        acc = tl.load(full_ptr + t * n_ch + offs_c, mask=c_ok, other=0.0).to(tl.float32) * \
            tl.load(w_ptr + offs_c * K, mask=c_ok, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            acc += tl.load(full_ptr + (t + j) * n_ch + offs_c, mask=c_ok, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + offs_c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * n_ch + offs_c, acc / (1.0 + tl.exp(-acc)), mask=c_ok)


def old_conv(x, window, w):
    t, c = x.shape
    full = torch.cat([window.to(x.dtype), x], dim=0).contiguous()
    out = torch.empty(t, c, device=x.device, dtype=torch.float32)
    _conv_rows_in_order[(triton.cdiv(c, 256),)](full, w.contiguous(), out, t, c, K=w.shape[1], BLOCK_C=256,
                                                num_warps=4)
    return out, full


@triton.jit
def _gdn_chunk_scan_kernel(wv_ptr, uk_ptr, q_ptr, qk_ptr, gexp_ptr, kdec_ptr, gend_ptr, s_ptr, o_ptr, sout_ptr,
                           n_chunks,
                           C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """The sequential part of the chunked form: one program per (head, BV value columns) carries
    S [DK, BV] through the chunks in order (see kernels/gdn for the algebra)."""
    h = tl.program_id(0)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, DK)
    offs_c = tl.arange(0, C)
    s = tl.load(s_ptr + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :])
    for c in range(n_chunks):
        hc = h * n_chunks + c
        uk = tl.load(uk_ptr + hc * C * DK + offs_c[:, None] * DK + offs_k[None, :])          # [C, DK]
        wv = tl.load(wv_ptr + hc * C * DV + offs_c[:, None] * DV + offs_v[None, :])          # [C, BV]
        delta = wv - tl.dot(uk, s, input_precision="ieee")
        qc = tl.load(q_ptr + hc * C * DK + offs_c[:, None] * DK + offs_k[None, :])
        qk = tl.load(qk_ptr + hc * C * C + offs_c[:, None] * C + offs_c[None, :])             # [C, C]
        ge = tl.load(gexp_ptr + hc * C + offs_c)
        o = ge[:, None] * tl.dot(qc, s, input_precision="ieee") + tl.dot(qk, delta, input_precision="ieee")
        tl.store(o_ptr + hc * C * DV + offs_c[:, None] * DV + offs_v[None, :], o)
        kd = tl.load(kdec_ptr + hc * C * DK + offs_c[:, None] * DK + offs_k[None, :])         # [C, DK]
        s = tl.load(gend_ptr + hc) * s + tl.dot(tl.trans(kd), delta, input_precision="ieee")
    tl.store(sout_ptr + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :], s)


def scan_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = 64, bv: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of gdn_chunked_ref: the previous prefill path (the baseline here; the engine runs
    kernels/gdn/prefill.py). The per-chunk terms (both triangular solves, Q K^T with decay)
    are batched over all chunks in PyTorch; the chunk-to-chunk state scan runs in one kernel.
    Needs dk, dv powers of two >= 16 (tensor-core tile sizes)."""
    from specfire.kernels.gdn.ref import chunk_terms

    h, dk, dv = k.shape[1], k.shape[2], v.shape[-1]
    c = chunk_terms(q, k, v, g, beta, chunk)
    n, t_len = c.n, c.t_len
    gexp = c.G.exp().contiguous()
    gend = c.G[..., -1].exp().contiguous()
    o = torch.empty(h, n, chunk, dv, device=q.device, dtype=torch.float32)
    s_out = torch.empty(h, dk, dv, device=q.device, dtype=torch.float32)
    bv = min(bv, dv)
    _gdn_chunk_scan_kernel[(h, dv // bv)](
        c.Wv.contiguous(), c.Uk.contiguous(), c.qb.contiguous(), c.QK.contiguous(), gexp, c.kdec.contiguous(), gend,
        state.float().contiguous(), o, s_out, n, C=chunk, DK=dk, DV=dv, BV=bv, num_warps=4, num_stages=1)
    return o.reshape(h, n * chunk, dv)[:, :t_len].transpose(0, 1).contiguous(), s_out


def old_chunked(q, k, v, g, beta, s):
    rep = v.shape[1] // k.shape[1]
    return scan_chunked(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta, s)


def ms(fn, reps: int = 10) -> float:
    """Median ms of fn after two warm-up calls."""
    fn(), fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return sorted(ts)[len(ts) // 2]


def inputs(cfg, t: int, seed: int = 0):
    """A layer's prefill inputs as core() makes them: the conv input, window and weight, then q, k
    (normalised key heads), v (a row-strided view of the conv output), gates and a state."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, kk = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    cdim = 2 * hk * dk + hv * dv
    x = rnd(t, cdim).bfloat16().float()
    win, w = rnd(kk - 1, cdim), rnd(cdim, kk, scale=0.5).bfloat16()
    conv, _ = G.conv_window_ref(x, win, w)
    q, k, v = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = G.l2norm_ref(q.reshape(t, hk, dk), dk ** -0.5)
    k = G.l2norm_ref(k.reshape(t, hk, dk))
    v = v.reshape(t, hv, dv)
    beta, g = G.gates_ref(rnd(t, hv), rnd(t, hv, scale=3.0), rnd(hv, scale=0.5), rnd(hv))
    return (x, win, w), (q, k, v, g, beta, rnd(hv, dk, dv, scale=0.1))


def errors(o, s, ro, rs) -> dict:
    return {"o_max_abs": (o - ro).abs().max().item(), "o_rel": ((o - ro).norm() / ro.norm()).item(),
            "state_max_abs": (s - rs).abs().max().item(), "state_rel": ((s - rs).norm() / rs.norm()).item()}


def check(cfg, t: int) -> dict:
    (x, win, w), (q, k, v, g, beta, s0) = inputs(cfg, t)
    r = v.shape[1] // k.shape[1]
    rc, rf = G.conv_window_ref(x, win, w)
    c_new, f_new = conv_window_triton(x, win, w)
    c_old, _ = old_conv(x, win, w)
    ro, rs = G.gdn_chunked_ref(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, g, beta, s0)
    o_new, s_new = gdn_prefill_triton(q, k, v, g, beta, s0)
    o_old, s_old = old_chunked(q, k, v, g, beta, s0)
    hk2, hv2 = k.shape[1] // 2, v.shape[1] // 2         # the second tensor-parallel half alone
    o_half, s_half = gdn_prefill_triton(q[:, hk2:], k[:, hk2:], v[:, hv2:], g[:, hv2:], beta[:, hv2:], s0[hv2:])
    return {"t": t, "conv_max_abs_new": (c_new - rc).abs().max().item(),
            "conv_max_abs_old": (c_old - rc).abs().max().item(),
            "window_equal": bool(torch.equal(f_new[-win.shape[0]:], rf[-win.shape[0]:])),
            "new": errors(o_new, s_new, ro, rs), "old": errors(o_old, s_old, ro, rs),
            "half_heads_bitwise": bool(torch.equal(o_half, o_new[:, hv2:]) and torch.equal(s_half, s_new[hv2:]))}


def timing(cfg, t: int) -> dict:
    (x, win, w), (q, k, v, g, beta, s0) = inputs(cfg, t)
    res = {"t": t, "conv_old_ms": ms(lambda: old_conv(x, win, w)),
           "conv_new_ms": ms(lambda: conv_window_triton(x, win, w)),
           "chunked_old_ms": ms(lambda: old_chunked(q, k, v, g, beta, s0)),
           "chunked_new_ms": ms(lambda: gdn_prefill_triton(q, k, v, g, beta, s0))}
    res["old_ms"] = res["conv_old_ms"] + res["chunked_old_ms"]
    res["new_ms"] = res["conv_new_ms"] + res["chunked_new_ms"]
    res["speedup"] = res["old_ms"] / res["new_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="27B", help="bench/common.py SHAPES")
    ap.add_argument("--t", default="1024,8192", help="prefill rows, comma-separated")
    ap.add_argument("--check", action="store_true", help="errors vs the reference and the head split first")
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gdn_prefill: needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False     # the reference in float32
    cfg = model_config(ns.shape)
    ts = [int(t) for t in ns.t.split(",")]
    checks = []
    if ns.check:
        print(f"{'T':>6} {'path':>4} {'o max abs':>10} {'o rel':>9} {'S max abs':>10} {'S rel':>9} "
              f"{'conv max abs':>12} {'half heads ==':>13}")
        for t in ts:
            c = check(cfg, t)
            checks.append(c)
            for p in ("old", "new"):
                e = c[p]
                print(f"{t:>6} {p:>4} {e['o_max_abs']:>10.2e} {e['o_rel']:>9.2e} {e['state_max_abs']:>10.2e} "
                      f"{e['state_rel']:>9.2e} {c['conv_max_abs_' + p]:>12.2e} "
                      f"{str(c['half_heads_bitwise']) if p == 'new' else '':>13}")
    times = [timing(cfg, t) for t in ts]
    print(f"{'T':>6} {'conv old':>9} {'conv new':>9} {'chunk old':>10} {'chunk new':>10} {'old ms':>8} {'new ms':>8} "
          f"{'speedup':>8}   (ms per layer)")
    for r in times:
        print(f"{r['t']:>6} {r['conv_old_ms']:>9.3f} {r['conv_new_ms']:>9.3f} {r['chunked_old_ms']:>10.3f} "
              f"{r['chunked_new_ms']:>10.3f} {r['old_ms']:>8.3f} {r['new_ms']:>8.3f} {r['speedup']:>7.2f}x")
    print(json.dumps({"bench": "gdn_prefill", "shape": ns.shape, "checks": checks, "times": times,
                      "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
