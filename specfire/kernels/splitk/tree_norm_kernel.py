"""The kernels of kernels/splitk/tree_norm.py (why, and what the bits rest on: there): the fused cross-rank
tree + residual add + RMSNorm, and the push of a finished subtree to the peers' slots."""
from __future__ import annotations

import os

import torch
from .._triton import triton, tl

SPIN_LIMIT = 1 << 26      # polls of the arrival counter before giving up (a dead peer: no eternal hang);
                          # then word 2 of the sync words is set and later waits on the buffer are skipped


@triton.jit
def _ll_value(v):
    return v.to(tl.int32).to(tl.float32, bitcast=True)        # the low 32 bits: the value


@triton.jit
def _slot(ptr, mask, LL: tl.constexpr):
    """One slot's float32 values: plain float32, or the values of LL words (see the LL form below)."""
    if LL:
        v = _ll_value(tl.load(ptr, mask=mask, other=0, cache_modifier=".cg"))
    else:
        v = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    return v


@triton.jit
def _slot_tree(base, offs, mask, W, MN, D1, D2, D4, FOLD: tl.constexpr, LL: tl.constexpr):
    """The canonical tree over W slots (1, 2, 4, 8) of one row: the same additions in the same order
    in both forms, so both give the same bits."""
    if FOLD:     # slots folded one by one like a binary counter: at most 4 live values an element
        acc = _slot(base, mask, LL)
        s0 = acc
        s1 = acc
        s2 = acc
        for j in range(W):
            acc = _slot(base + j * MN, mask, LL)
            if j % 2 == 1:
                acc = s0 + acc
                if j % 4 == 3:
                    acc = s1 + acc
                    if j % 8 == 7:
                        acc = s2 + acc
                    else:
                        s2 = acc
                else:
                    s1 = acc
            else:
                s0 = acc
        h = acc                             # slot W - 1 closes the whole tree (W a power of two)
    else:
        m1 = offs < D1                      # D1, D2, D4: D where W > 1, 2, 4, else 0 (slots absent)
        m2 = offs < D2
        m4 = offs < D4
        p0 = _slot(base, mask, LL)
        p1 = _slot(base + MN, m1, LL)
        p2 = _slot(base + 2 * MN, m2, LL)
        p3 = _slot(base + 3 * MN, m2, LL)
        p4 = _slot(base + 4 * MN, m4, LL)
        p5 = _slot(base + 5 * MN, m4, LL)
        p6 = _slot(base + 6 * MN, m4, LL)
        p7 = _slot(base + 7 * MN, m4, LL)
        # absent levels selected away (never added)
        h = tl.where(W > 1, p0 + p1, p0)
        h = tl.where(W > 2, h + (p2 + p3), h)
        h = tl.where(W > 4, h + ((p4 + p5) + (p6 + p7)), h)
    return h


@triton.jit
def _add_norm_row(h, x_ptr, w_ptr, s_ptr, y_ptr, row, offs, mask, D, stride_x, eps):
    """Residual + the tree's sum (rounded to the model dtype first), stored; then its RMSNorm."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = h.to(x.dtype)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(s_ptr + row * D + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    wn = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * D + offs, (xf * inv * (1.0 + wn)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["W", "M", "MN", "D1", "D2", "D4", "target"])
def _tree_add_norm_kernel(p_ptr, x_ptr, w_ptr, s_ptr, y_ptr, sync_ptr, W, M, MN, D, D1, D2, D4, stride_x, eps, target,
                          BLOCK: tl.constexpr, SPIN: tl.constexpr, FOLD: tl.constexpr = False):
    row = tl.program_id(0)
    if target > 0:                         # the peers' slots arrive by push: wait for every arrival
        v = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="sys")
        i = 0
        if tl.load(sync_ptr + 2, volatile=True) != 0:
            i = SPIN                       # a wait on this buffer timed out before: do not wait again
        while (v < target) & (i < SPIN):
            v = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="sys")
            i += 1
        if v < target:                     # timed out (a dead or lost peer): say so, sticky
            tl.atomic_xchg(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    h = _slot_tree(p_ptr + row * D + offs, offs, mask, W, MN, D1, D2, D4, FOLD, False)
    _add_norm_row(h, x_ptr, w_ptr, s_ptr, y_ptr, row, offs, mask, D, stride_x, eps)
    if target > 0:                         # the last row program re-arms the slot for its next use
        done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == M - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


_NO_SYNC: dict[torch.device, torch.Tensor] = {}
NORM_WARPS = 32          # as kernels/small/kernel.py's wide norms (D >= 2048)


def fold_slots() -> bool:
    """SPECFIRE_TREE_NORM_FOLD=1: the consumer folds the slots in a loop (fewer live registers;
    measured on one H200: the straight-line form costs 4.45 us a call against add_rms_norm's 1.94).
    Not measured on a mesh yet, so off by default; the same on every degree either way."""
    return os.environ.get("SPECFIRE_TREE_NORM_FOLD", "0") == "1"


def tree_add_rms_norm(parts: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float,
                      sync: torch.Tensor | None = None, target: int = 0,
                      fold: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [W, M, D] float32 (W in 1, 2, 4, 8), x [M, D] residual -> (new residual, normed), x's
    dtype. With `sync`, first waits until its arrival word reaches `target`."""
    wn, m, d = parts.shape
    if wn not in (1, 2, 4, 8) or parts.dtype != torch.float32 or tuple(x.shape) != (m, d):
        raise ValueError(f"tree_add_rms_norm: parts {list(parts.shape)} {parts.dtype} (1/2/4/8 float32 slots) "
                         f"does not fit residual {list(x.shape)}")
    if not parts.is_contiguous():
        raise ValueError("tree_add_rms_norm: parts must be contiguous")
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if sync is None:        # an int32 word all the same: one compiled kernel for every degree and mode
        sync = _NO_SYNC.get(x.device)
        if sync is None:
            sync = _NO_SYNC[x.device] = torch.zeros(4, dtype=torch.int32, device=x.device)
        target = 0
    if m:
        _tree_add_norm_kernel[(m,)](parts, x, w, s, y, sync, wn, m, m * d, d, d * (wn > 1), d * (wn > 2), d * (wn > 4),
                                    x.stride(0), eps, target,
                                    BLOCK=triton.next_power_of_2(d), SPIN=SPIN_LIMIT,
                                    FOLD=fold_slots() if fold is None else fold,
                                    num_warps=NORM_WARPS if d >= 2048 else 4)
    return s, y


@triton.jit(do_not_specialize=["R", "W", "MN"])
def _push_kernel(src_ptr, bufs_ptr, sigs_ptr, R, W, MN, BLOCK: tl.constexpr):
    """Slot R of every peer's buffer <- src (a block of BLOCK elements a program), then one
    release-add on each peer's arrival word (after every thread's stores: the barrier)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    v = tl.load(src_ptr + offs, mask=mask, other=0.0)
    for j in range(1, W):
        peer = (R + j) % W
        dst = tl.load(bufs_ptr + peer).to(tl.pointer_type(tl.float32))
        tl.store(dst + R * MN + offs, v, mask=mask)
    tl.debug_barrier()
    for j in range(1, W):
        peer = (R + j) % W
        sig = tl.load(sigs_ptr + peer).to(tl.pointer_type(tl.int32))
        tl.atomic_add(sig, 1, sem="release", scope="sys")


PUSH_BLOCK = 4096


@triton.jit(do_not_specialize=["R", "W", "MN"])
def _push_ll_kernel(src_ptr, bufs_ptr, epoch_ptr, R, W, MN, BLOCK: tl.constexpr):
    """src as LL words (this use's epoch as flag) into slot R of every rank's buffer, this one's too."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    v = tl.load(src_ptr + offs, mask=mask, other=0.0)
    e = (tl.load(epoch_ptr, volatile=True) + 1).to(tl.int64)
    word = (e << 32) | (v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    for j in range(0, W):
        dst = tl.load(bufs_ptr + (R + j) % W).to(tl.pointer_type(tl.int64))
        tl.store(dst + R * MN + offs, word, mask=mask)


def push_rows(src: torch.Tensor, push) -> None:
    """Send a float32 subtree to every peer (the producers that cannot push from their own
    epilogue; for LL, to this rank's slot too, as words); sets push.target."""
    n = src.numel()
    grid = (triton.cdiv(n, PUSH_BLOCK),)
    if push.ll:
        if n:
            _push_ll_kernel[grid](src, push.bufs, push.sigs, push.rank, push.world, n, BLOCK=PUSH_BLOCK, num_warps=4)
    elif push.world > 1 and n:
        _push_kernel[grid](src, push.bufs, push.sigs, push.rank, push.world, n, BLOCK=PUSH_BLOCK, num_warps=4)
    push.target = grid[0] * (push.world - 1)


# ---- the low-latency (LL) form: 8-byte (float32 value, 32-bit flag) words -----------------------

@triton.jit(do_not_specialize=["W", "M", "MN", "D1", "D2", "D4", "wait"])
def _tree_add_norm_ll_kernel(p_ptr, x_ptr, w_ptr, s_ptr, y_ptr, sync_ptr, W, M, MN, D, D1, D2, D4, stride_x, eps,
                             wait, BLOCK: tl.constexpr, SPIN: tl.constexpr, FOLD: tl.constexpr = False):
    """_tree_add_norm_kernel on LL words. With `wait`: polls this row's words of every slot until
    each flag is this use's epoch (sync word 1, plus one), then the last row program advances the
    epoch. A word carries its value and flag in one 8-byte store, so a seen flag means a seen value."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    base = p_ptr + row * D + offs
    if wait > 0:
        exp = tl.load(sync_ptr + 1, volatile=True) + 1
        i = 0
        if tl.load(sync_ptr + 2, volatile=True) != 0:
            i = SPIN
        bad = wait
        while (bad > 0) & (i < SPIN):
            bad = wait * 0
            for j in range(W):
                f = (tl.load(base + j * MN, mask=mask, other=0, volatile=True) >> 32).to(tl.int32)
                bad += tl.sum(tl.where(mask & (f != exp), 1, 0), axis=0)
            i += 1
        if bad > 0:
            tl.atomic_xchg(sync_ptr + 2, 1, sem="relaxed", scope="gpu")
    h = _slot_tree(base, offs, mask, W, MN, D1, D2, D4, FOLD, True)
    _add_norm_row(h, x_ptr, w_ptr, s_ptr, y_ptr, row, offs, mask, D, stride_x, eps)
    if wait > 0:
        done = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
        if done == M - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(sync_ptr + 1, 1, sem="relaxed", scope="gpu")     # the next use's epoch


def ll_pack(parts: torch.Tensor) -> torch.Tensor:
    """float32 slots -> LL words with flag 0 (slots already present: no wait)."""
    return parts.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def tree_add_rms_norm_ll(parts: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float,
                         sync: torch.Tensor | None = None, fold: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_add_rms_norm on LL words [W, M, D] int64; with `sync` (this buffer's words: done,
    epoch, timed out) waits for this use's flags first."""
    wn, m, d = parts.shape
    if wn not in (1, 2, 4, 8) or parts.dtype != torch.int64 or tuple(x.shape) != (m, d) or not parts.is_contiguous():
        raise ValueError(f"tree_add_rms_norm_ll: parts {list(parts.shape)} {parts.dtype} (1/2/4/8 contiguous int64 "
                         f"slots) does not fit residual {list(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    s = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    wait = 1 if sync is not None else 0
    if sync is None:
        sync = _NO_SYNC.get(x.device)
        if sync is None:
            sync = _NO_SYNC[x.device] = torch.zeros(4, dtype=torch.int32, device=x.device)
    if m:
        _tree_add_norm_ll_kernel[(m,)](parts, x, w, s, y, sync, wn, m, m * d, d, d * (wn > 1), d * (wn > 2),
                                       d * (wn > 4), x.stride(0), eps, wait, BLOCK=triton.next_power_of_2(d),
                                       SPIN=SPIN_LIMIT, FOLD=fold_slots() if fold is None else fold,
                                       num_warps=NORM_WARPS if d >= 2048 else 4)
    return s, y
