"""Offline sm_90 compile of the decode kernels' PDL variants (no GPU needed): each launcher is run
on CPU tensors with Triton's launches turned into compiles for an H200 target (compute capability
9.0), and the PTX of every kernel is checked for what kernels/pdl.py promises:

- PDL on: `griddepcontrol.wait` and `griddepcontrol.launch_dependents` present, the launch option
  set, and no global load, store or atomic before the wait in the PTX (the 4-bit GEMV's L2
  prefetches of its codes, `cp.async.bulk.prefetch.L2`, are the only memory requests allowed
  there);
- PDL off (SPECFIRE_PDL=0 equivalent): no griddepcontrol instruction at all.

    python bench/pdl_compile.py            # with a Triton that has an sm_90 ptxas (the GPU machine's version)

Prints one line per kernel variant and exits non-zero on any failure.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

if importlib.util.find_spec("safetensors") is None:   # imported by the package; no checkpoint is read here
    import types
    _st = types.ModuleType("safetensors")
    _st.safe_open = None
    sys.modules["safetensors"] = _st
    sys.modules["safetensors.torch"] = types.ModuleType("safetensors.torch")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _OfflineDriver:
    """Just enough of a driver for JITFunction.run to compile for sm_90 without a device."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


COMPILED: list = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    k = _run(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.append((self.fn.__name__, k))
    return k


MEM = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|atom\.|red\.|cp\.async\.(ca|cg)|ld\.volatile)", re.M)


def check(name: str, k, want_pdl: bool) -> list[str]:
    ptx = k.asm["ptx"]
    errs = []
    has_wait = "griddepcontrol.wait" in ptx
    has_rel = "griddepcontrol.launch_dependents" in ptx
    if want_pdl:
        if not (has_wait and has_rel):
            errs.append("griddepcontrol wait/launch_dependents missing")
        if not getattr(k.metadata, "launch_pdl", False):
            errs.append("launch_pdl option not set")
        before = ptx[:ptx.find("griddepcontrol.wait")] if has_wait else ""
        if (ptx.find("griddepcontrol.launch_dependents") < ptx.find("griddepcontrol.wait")) != (want_pdl == 2):
            errs.append("release / wait order not the one asked for")
        if MEM.search(before):
            errs.append(f"memory access before the wait: {MEM.search(before).group(0).strip()}")
    elif has_wait or has_rel:
        errs.append("griddepcontrol emitted with PDL off")
    pf = ptx.count("cp.async.bulk.prefetch.L2")
    print(f"{['off', 'PDL wait-first', 'PDL release-first'][want_pdl]:17s} {name:24s} wait={has_wait} "
          f"release={has_rel} l2_prefetch={pf} {'OK' if not errs else 'FAIL: ' + '; '.join(errs)}")
    return errs


def launch_all(dev: str) -> None:
    from specfire.kernels.attention import kernel as ak
    from specfire.kernels.attention import fused as attn_fused
    from specfire.kernels.gdn import fused as gdn_fused
    from specfire.kernels.head import kernel as head_kernel
    from specfire.kernels.gemv import kernel as triton_gemv
    from specfire.kernels.q4 import gemv as triton_quant
    from specfire.kernels.small import kernel as triton_small
    from specfire.kernels.norm import kernel as triton_norm
    from specfire.kernels.splitk import fused as triton_splitk
    from specfire.kernels.q4 import QuantWeight

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    k = 5120

    def qw(n, kk=k):
        q = torch.randint(0, 256, (n, kk // 2), generator=g, dtype=torch.uint8)
        s = torch.rand(kk // 128, n, generator=g).to(bf)
        return QuantWeight(q, s, s.clone(), False, bf)

    a, b, c = qw(256), qw(192), qw(128)
    for m in (1, 12):
        x = torch.randn(m, k, generator=g).to(bf)
        for (n, kk), cfg in triton_quant._MEASURED.items():
            if kk == k and n in (34816, 248320, 14336, 12288):
                triton_quant.q4_group(x, [a, b, c] if n == 14336 else [a], cfg)
        triton_quant.q4_group(x, [a], triton_quant.Q4Config(64, split_k=4, sem=False, wa=True, rows=8))
    x = torch.randn(1, k, generator=g).to(bf)
    w1, w2 = torch.randn(48, k, generator=g).to(bf), torch.randn(48, k, generator=g).to(bf)
    triton_gemv.gemv_group(x, [w1, w2], [None, None])
    triton_gemv.gemv(x, torch.randn(256, k, generator=g).to(bf))
    triton_gemv.gemv(x, torch.randn(256, k, generator=g).to(bf), triton_gemv.GemvConfig(64, 128, split_k=4))
    h = torch.randn(1, k, generator=g).to(bf)
    wn = torch.randn(k, generator=g).to(bf)
    triton_norm.rms_norm_triton(h, wn, 1e-6)
    triton_norm.add_rms_norm_triton(h, h.clone(), wn, 1e-6)
    triton_small.silu_mul_triton(torch.randn(1, 17408).to(bf), torch.randn(1, 17408).to(bf))
    triton_norm.gated_rms_norm_triton(torch.randn(1, 48, 128).to(bf), torch.randn(1, 48, 128).to(bf),
                                       torch.randn(128).to(bf), 1e-6)
    triton_small.apply_rope_triton(torch.randn(1, 24, 256).to(bf), torch.randn(1, 64), torch.randn(1, 64))
    # Gated DeltaNet decode (27B: 16 key heads x 128, 48 value heads x 128, conv 4), split heads as default
    hk, hv, dk, dv, kc = 16, 48, 128, 128, 4
    ch = 2 * hk * dk + hv * dv
    for pipe, merged in ((False, False), (True, False), (True, True)):   # as written, pipelined, merged
        gdn_fused.gdn_decode_triton(torch.randn(1, ch).to(bf), torch.randn(1, hv).to(bf), torch.randn(1, hv).to(bf),
                                    torch.randn(kc - 1, ch).to(bf), torch.randn(ch, kc).to(bf), torch.randn(hv),
                                    torch.randn(hv), torch.randn(hv, dk, dv), hk, dk, dv,
                                    z=torch.randn(1, hv * dv).to(bf), norm_w=torch.randn(dv).to(bf), eps=1e-6,
                                    pipe=pipe, merged=merged)
    # attention (24 query heads, 4 KV heads, head 256): q/k norm + rotary + KV write, split + combine, gate
    hq, hkv, d, L = 24, 4, 256, 704
    kcache, vcache = torch.zeros(L, hkv, d).to(bf), torch.zeros(L, hkv, d).to(bf)
    pos = torch.zeros(1, dtype=torch.int64)
    q = attn_fused.qk_norm_rope_write_triton(torch.randn(1, hq, 2 * d).to(bf), torch.randn(1, hkv, d).to(bf),
                                             torch.randn(1, hkv, d).to(bf), torch.randn(d).to(bf),
                                             torch.randn(d).to(bf), 1e-6, torch.randn(1, 64), torch.randn(1, 64),
                                             kcache, vcache, pos)
    attn_fused.qk_norm_rope_write_triton(torch.randn(4, hq, 2 * d).to(bf), torch.randn(4, hkv, d).to(bf),
                                         torch.randn(4, hkv, d).to(bf), torch.randn(d).to(bf),
                                         torch.randn(d).to(bf), 1e-6, torch.randn(L, 64), torch.randn(L, 64),
                                         kcache, vcache, pos, table=True)      # the MTP head's rotary table
    # the MTP head's fc input: embedding gather + both norms + cat (+ group sums) in one kernel
    head_kernel.fc_input_triton(torch.zeros(4, dtype=torch.int64), torch.randn(64, k).to(bf),
                               torch.randn(4, k).to(bf), wn, wn, 1e-6, 1e-6)
    # the chain's greedy pick (32,768-row draft vocabulary) and its row-n selection
    drafts = torch.zeros(3, dtype=torch.int64)
    head_kernel.pick_triton(torch.randn(1, 32768).to(bf), drafts, 0, pos)
    head_kernel.pick_triton(torch.randn(1, 32768).to(bf), drafts, 2, None)
    head_kernel.select_triton(torch.randn(4, k).to(bf), torch.randn(4, k).to(bf), pos, pos)
    o = ak.attention_rows_triton(q, kcache, vcache, pos, d ** -0.5)
    attn_fused.out_gate_triton(o.to(bf), torch.randn(1, hq, 2 * d).to(bf))
    # canonical split-K chunk kernels (mesh-equal mode)
    bounds = torch.tensor([0, 2560, 5120], dtype=torch.int32)
    wd = torch.randn(512, k, generator=g).to(bf)
    triton_splitk.tree_combine(triton_splitk.chunk_partials(x, wd, bounds), bf)
    triton_splitk.gemv_chunks_fused(x, wd, bounds, bf)


def main() -> None:
    from specfire.kernels import pdl
    from specfire.kernels.q4 import gemv as triton_quant
    from specfire.kernels import xsum

    # the producers' folded group sums (kernels/xsum.py) for CPU stand-in tensors, as on the GPU
    xsum.want = lambda y, d: xsum.enabled() and d % xsum.G == 0 and 0 < y.shape[0] <= xsum.MAX_ROWS

    driver.set_active(_OfflineDriver())
    JITFunction.run = _compile_only
    pdl.supported = lambda device: True                # an H200 as far as the launchers know
    pdl.on = lambda x: pdl.ORDER if pdl.ENABLED else 0  # CPU tensors stand in for the device ones
    errs = 0
    for enabled, order, fold in ((True, pdl.WAIT_FIRST, "1"), (True, pdl.RELEASE_FIRST, "1"),
                                 (False, pdl.WAIT_FIRST, "1"), (True, pdl.WAIT_FIRST, "plain"),
                                 (False, pdl.WAIT_FIRST, "plain"), (True, pdl.WAIT_FIRST, "0")):
        pdl.ENABLED, pdl.ORDER = enabled, order
        os.environ["SPECFIRE_XSUM_FOLD"] = fold       # sum(x) fold: tree, plain, off (kernels/xsum.py)
        triton_quant.PDL_PREFETCH = 2 if enabled else 0      # the prefetch variant compiled too
        COMPILED.clear()
        launch_all("cpu")
        seen = set()
        for name, k in COMPILED:
            key = (name, k.hash if hasattr(k, "hash") else id(k))
            if key in seen:
                continue
            seen.add(key)
            errs += bool(check(name, k, order if enabled else 0))
    print("FAILED" if errs else "all OK", f"({errs} failing variants)")
    sys.exit(1 if errs else 0)


if __name__ == "__main__":
    main()
