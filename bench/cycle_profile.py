"""Where an MTP k=3 cycle's time goes beyond the draft chain, on one GPU (27B shape, random weights,
4-bit then bf16), and what the cycle's fixed-cost changes buy, each measured in the same process.

    PYTHONPATH=$PWD python bench/cycle_profile.py --shape 27B --vocab 32768 --budget-s 200 --out $OUT
    ... --variants gdn32w2p,m32w2,m16w1,gdn32w2p --bf16-variants "" --long 0 --reps 2
    PYTHONPATH=$PWD python bench/cycle_profile.py --smoke          # the flow on the CPU, tiny shape
    TRITON_INTERPRET=1 ... --smoke                                 # + the kernel bit check, interpreted

Checkpoints: bench/tp_mtp.py's 4-bit one and bench/tp.py's bf16 one, both with final norms -1
(every logit ties, greedy picks token 0, inside the draft vocabulary [0, N): every draft is
accepted), loaded with `draft_vocab=N`. 512-token random prompt, 64 new tokens, greedy, CUDA graphs,
through `LLM.generate`.

First (on a GPU, or interpreted with TRITON_INTERPRET=1): the GDN kernels' bits on the shape's GDN
geometry: the fused rows kernel over 4 rows == 4 single-row launches each committed (outputs and
logs), commit(n) of the 4 rows == n+1 single rows committed, and the unfused rows kernel's own final
state == its log replayed by the commit kernel; both program forms.

Per variant (switched in the process, the captured graphs dropped where a switch changes them):
  whole4     the fused GDN kernel with one program per whole value head (4 warps, the gated norm
             inside; kernels/gdn/fused.py BV None, NUM_WARPS 4)
  gdn64/32   a head's value columns split over 2 / 4 programs (bv 64 / 32, 2 / 1 warps, the gated
             norm as its own kernel); gdn32w2 / gdn64w4 the same on 2 / 4 warps (docs/BENCHMARKS.md
             "Seventh wave: where an MTP cycle's time goes"). These run the plain row loop (PIPE off).
  ...p       (gdn32w2p, whole4p) the same with the row loop software-pipelined (kernels/gdn/fused.py PIPE:
             each row's projections, a, b, z loaded one row ahead); gdn32w2p was the default until the
             merged form (docs/BENCHMARKS.md "Eighth wave: the Gated DeltaNet row loop software-pipelined").
  m32w2 ...  the merged-reduction row loop (kernels/gdn/fused.py MERGED, _gdn_merged_kernel: one four-operand
             reduce a row, the conv window in registers) at bv / warps 32/2 (the default), 32/1, 16/1,
             16/2, 8/1, 64/2 (docs/BENCHMARKS.md "Ninth wave: the Gated DeltaNet rows ...").
  q4off / q4disc / q4mt / q4ilp / q4dil / q4all  gdn32w2p (the plain pipelined loop, as measured) with the 4-bit GEMV's ninth-wave switches
             (kernels/q4/gemv.py) all off / DISCARD only (split-K partials dropped from L2 after the
             combine) / M_TILES only (--q4-mtiles: per-(N, K, M) tiles from bench/q4_rows4.py) /
             COMBINE_ILP only (the combine's loads four at a time) / DISCARD + COMBINE_ILP / all on
             (every graph recaptured on a switch)
  chain0 / chain1 / chain1np  gdn32w2p (as measured) with the MTP head's fused rows step off / on
             (kernels/head, SPECFIRE_CHAIN_FUSE; only the chain's graphs recaptured on a
             switch); chain1np: on without the fused greedy pick / row select (SPECFIRE_CHAIN_PICK=0).
             The profile then also lists the chain graph's kernels one by one.
  eighth     the eighth wave's path (gdn32w2p, q4off, chain0 together, the head's prompt catch-up
             unfused and no queued-chain prefix for a shorter last cycle): the ninth wave's baseline.
  fold / nofold  gdn32w2p with the 4-bit GEMVs' sum(x) folded into the kernels that write their
             inputs (kernels/xsum.py, the pairwise tree) / made by the GEMV's own launch
             (SPECFIRE_XSUM_FOLD=1 / 0; the trunk's and the MTP chain's graphs recaptured on a
             switch); foldplain the fold with tl.sum in the producers (SPECFIRE_XSUM_FOLD=plain).
             A variant without the key leaves the fold as the environment has it.
The rows forward writes no state; the commit replays the logged rows (model/state.py, kernels/gdn
commit_rows). The earlier per-row state captures and copying commit are gone: their figures are
the seventh wave's (docs/BENCHMARKS.md).
it reports: the AR step and the MTP k=3 cycle through `LLM.generate` (median of --reps runs each),
MTP == AR, each captured graph replayed alone (1-row and 4-row trunk graphs, the commit graph, the
chain), the cycle's device phases (CUDA events around each call the engine makes: verify, accept,
the (n, tokens) copy, chain, commit, and the device time not inside any of them, which is idle time
waiting for the host plus the few untimed copies), the host's path from the read to the next verify
launch, and torch.profiler's device time by kernel family over replays of the 1-row and the 4-row
graph (after every timing: a profiler session leaves the host's launches slower for the rest of
the process). --long N: one more AR and MTP run of N tokens on the first two variants (the
per-request costs spread thinner), and the MTP head's prompt catch-up (`MtpDrafter.begin`, which
the engine queues before the decode clock starts and the device runs after) timed alone. Then a
random head (final norms +1: drafts rejected) checks MTP == AR on each variant's path.
One JSON line per record on stdout and in OUT/cycle_profile.jsonl.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from cycle_host import Patches  # noqa: E402
from tp import CEILING, Log, _time_graph, job_ckpt, md5, smoke_shapes, step_bytes  # noqa: E402

VARIANTS = {
    "whole4": dict(gdn=(None, 4), pipe=False),
    "gdn64": dict(gdn=(64, 2), pipe=False),
    "gdn32": dict(gdn=(32, 1), pipe=False),
    "gdn32w2": dict(gdn=(32, 2), pipe=False),
    "gdn64w4": dict(gdn=(64, 4), pipe=False),
    "gdn32w2p": dict(gdn=(32, 2), pipe=True),
    "whole4p": dict(gdn=(None, 4), pipe=True),
    # the default GDN form with the 4-bit GEMV inputs' group sums folded into their producers
    # (kernels/xsum.py, SPECFIRE_XSUM_FOLD) or made by the GEMV's own sum(x) launch
    "fold": dict(gdn=(32, 2), pipe=True, fold="1"),
    "nofold": dict(gdn=(32, 2), pipe=True, fold="0"),
    "foldplain": dict(gdn=(32, 2), pipe=True, fold="plain"),
    # the merged-reduction row loop (kernels/gdn/fused.py MERGED): split 32 / 2 warps (the default), 32 / 1,
    # 16 / 1, 16 / 2, 8 / 1, 64 / 2
    "m32w2": dict(gdn=(32, 2), pipe=True, merged=True),
    "m32w1": dict(gdn=(32, 1), pipe=True, merged=True),
    "m16w1": dict(gdn=(16, 1), pipe=True, merged=True),
    "m16w2": dict(gdn=(16, 2), pipe=True, merged=True),
    "m8w1": dict(gdn=(8, 1), pipe=True, merged=True),
    "m64w2": dict(gdn=(64, 2), pipe=True, merged=True),
    # the 4-bit GEMV's ninth-wave switches (kernels/q4/gemv.py): (DISCARD: split-K partials' L2 lines
    # dropped after the combine, M_TILES: the --q4-mtiles per-(N, K, M) tiles, COMBINE_ILP: the
    # combine's loads four at a time), the eighth wave's GDN form (gdn32w2p)
    "q4off": dict(gdn=(32, 2), pipe=True, q4=(False, False, False)),
    "q4disc": dict(gdn=(32, 2), pipe=True, q4=(True, False, False)),
    "q4mt": dict(gdn=(32, 2), pipe=True, q4=(False, True, False)),
    "q4ilp": dict(gdn=(32, 2), pipe=True, q4=(False, False, True)),
    "q4dil": dict(gdn=(32, 2), pipe=True, q4=(True, False, True)),
    "q4all": dict(gdn=(32, 2), pipe=True, q4=(True, True, True)),
    # the default form with the MTP head's fused rows step off / on (kernels/head,
    # SPECFIRE_CHAIN_FUSE; only the chain's graphs are recaptured on a switch)
    "chain0": dict(gdn=(32, 2), pipe=True, chain="0"),
    "chain1": dict(gdn=(32, 2), pipe=True, chain="1"),
    "chain1np": dict(gdn=(32, 2), pipe=True, chain="1", pick="0"),     # without the fused pick / select
    # the eighth wave's whole path (main before the ninth wave's three changes): the pipelined loop, the
    # 4-bit GEMV's switches off, the unfused chain
    "eighth": dict(gdn=(32, 2), pipe=True, q4=(False, False, False), chain="0", catchup=False),
}
MERGED_CHECK = ((32, 2), (16, 1), (16, 2), (8, 1), (None, 4))   # merged forms the kernel check runs
Q4_MTILES: dict = {}        # --q4-mtiles: (N, K, M) -> (block_n, num_warps, num_stages)

def _q4_defaults():
    """The 4-bit GEMV's switches as the module starts (the environment's), restored for variants
    without a "q4" key (before: they kept the previous variant's switches)."""
    from specfire.kernels.q4 import gemv as triton_quant
    return (triton_quant.DISCARD, True, triton_quant.COMBINE_ILP), dict(triton_quant.M_TILES)


Q4_DEFAULT, Q4_DEFAULT_TILES = _q4_defaults()
FAMILIES = (("q4 GEMV", ("_q4_kernel",)), ("q4 sum(x)", ("_xsum",)), ("split-K sum", ("_splitk_sum",)),
            ("bf16 GEMV", ("_gemv",)), ("GDN", ("gdn",)), ("attention", ("attn",)),
            ("norms", ("norm",)), ("rotary/KV write", ("rope", "qk_")), ("argmax/accept", ("argmax", "accept")),
            ("copies", ("copy", "Memcpy", "memcpy", "index", "gather", "elementwise")))


class LaunchCount:
    """Counts the launches of a Triton kernel made through it (captures and eager runs: a graph
    replay launches without Python), e.g. the 4-bit GEMV's own sum(x) kernel."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


XSUM_COUNT: LaunchCount | None = None


class Phases(Patches):
    """Each wrapped call's host span and, on CUDA, timing events before and after the work it
    queues (label, host t0, host t1, event0, event1)."""

    def __init__(self, cuda: bool):
        super().__init__()
        self.cuda, self.on = cuda, False
        self.rec: list[tuple] = []

    def wrap(self, owner, attr: str, label) -> None:
        fn, ph = getattr(owner, attr), self

        def timed(*a, **kw):
            if not ph.on:
                return fn(*a, **kw)
            lab = label(*a) if callable(label) else label
            e0 = e1 = None
            if ph.cuda:
                e0 = torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                t1 = time.perf_counter_ns()
                if ph.cuda:
                    e1 = torch.cuda.Event(enable_timing=True)
                    e1.record()
                ph.rec.append((lab, t0, t1, e0, e1))
        self._patch(owner, attr, timed)

    def cycles(self, rows: int) -> dict:
        """Medians (us) over the cycles from one `rows`-row verify to the next."""
        if self.cuda:
            torch.cuda.synchronize()
        rec = self.rec
        starts = [i for i, r in enumerate(rec) if r[0] == f"verify{rows}"]
        per = []
        for i, j in zip(starts, starts[1:]):
            inside = rec[i:j]
            d: dict[str, float] = {}
            reads = [r for r in inside if r[0] == "read"]
            if reads:
                d["host.read_wait"] = (reads[-1][2] - reads[-1][1]) / 1e3
                d["host.read_end_to_next_verify"] = (rec[j][1] - reads[-1][2]) / 1e3
            d["host.cycle"] = (rec[j][1] - rec[i][1]) / 1e3
            for lab, t0, t1, *_ in inside:
                d[f"host.{lab}"] = d.get(f"host.{lab}", 0.0) + (t1 - t0) / 1e3
            if self.cuda:
                span = rec[i][3].elapsed_time(rec[j][3]) * 1e3
                d["dev.cycle"] = span
                timed = 0.0
                for lab, t0, t1, e0, e1 in inside:
                    if lab in ("read", "propose"):
                        continue                       # host-side calls: no device work of their own
                    v = e0.elapsed_time(e1) * 1e3
                    d[f"dev.{lab}"] = d.get(f"dev.{lab}", 0.0) + v
                    timed += v
                d["dev.untimed_or_idle"] = span - timed
                # the device's wait for the host right before the next verify: last timed phase's end -> verify start
                last = max((r for r in inside if r[0] not in ("read", "propose")), key=lambda r: r[2])
                d["dev.wait_before_verify"] = last[4].elapsed_time(rec[j][3]) * 1e3
            per.append(d)
        keys = sorted({k for p in per for k in p})
        return {k: round(statistics.median(p.get(k, 0.0) for p in per), 1) for k in keys} | {"cycles": len(per)}


def families(replay, reps: int = 4, top: int = 14) -> dict:
    """torch.profiler device time per replay by kernel family, and the `top` kernels (name:
    device us and launches per replay)."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    kern: dict[str, dict] = {}
    for e in p.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0) if us is None else us
        if us > 0:
            kern[e.key] = {"us": round(us / reps, 1), "calls": e.count / reps}
    fam = {name: {"us": 0.0, "kernels": 0.0} for name, _ in FAMILIES}
    fam["other"] = {"us": 0.0, "kernels": 0.0}
    for name, v in kern.items():
        key = next((f for f, pats in FAMILIES if any(pt in name for pt in pats)), "other")
        fam[key]["us"] += v["us"]
        fam[key]["kernels"] += v["calls"]
    fam = {k: {"us": round(v["us"], 1), "kernels": round(v["kernels"])} for k, v in fam.items() if v["kernels"]}
    top = dict(sorted(kern.items(), key=lambda kv: -kv[1]["us"])[:top])
    return {"total_us": round(sum(v["us"] for v in fam.values()), 1), "families": fam, "top": top}


def apply(llm, name: str, current: dict) -> None:
    """Switch the process to variant `name`; drop the graphs the switch changes."""
    from specfire.kernels.gdn import fused as gdn_fused
    from specfire.runtime.graphs import RowsGraphs

    v = VARIANTS[name]
    trunk = llm.engine.trunk
    gdn_fused.BV, gdn_fused.NUM_WARPS = v["gdn"]
    gdn_fused.PIPE = v["pipe"]
    gdn_fused.MERGED = v.get("merged", False)
    fold_changed = "fold" in v and current.get("fold") != v["fold"]
    from specfire.kernels.q4 import gemv as triton_quant
    if "q4" in v or "q4" in current:            # a variant without the key runs the module's defaults
        q4 = v.get("q4", Q4_DEFAULT)
        fold_changed |= current.get("q4", Q4_DEFAULT) != q4               # the chain's GEMVs change too
        triton_quant.DISCARD, triton_quant.COMBINE_ILP = q4[0], q4[2]
        triton_quant.M_TILES.clear()
        triton_quant.M_TILES.update(Q4_DEFAULT_TILES if q4 is Q4_DEFAULT else Q4_MTILES if q4[1] else {})
    chain_changed = (current.get("chain", "1"), current.get("pick", "1")) != (v.get("chain", "1"), v.get("pick", "1"))
    if "fold" in v:
        os.environ["SPECFIRE_XSUM_FOLD"] = v["fold"]                    # read at each launch (kernels/xsum.py)
    os.environ["SPECFIRE_CHAIN_FUSE"] = v.get("chain", "1")             # read at each head step (kernels/head)
    os.environ["SPECFIRE_CHAIN_PICK"] = v.get("pick", "1")              # read at each chain
    trunk_keys = lambda d: {k: x for k, x in d.items() if k not in ("chain", "pick")}    # noqa: E731
    if trunk.graphs is not None:
        if trunk_keys(current) != trunk_keys(v) and (current or trunk.graphs.graphs):
            trunk.graphs = RowsGraphs(trunk.model, trunk.state)        # the rows graphs bake the kernel in
            torch.cuda.empty_cache()
    mtp = llm.engine.drafters.get("mtp")
    if (fold_changed or chain_changed) and mtp is not None and mtp.graphs is not None:
        mtp.graphs.clear()                                              # the chain's GEMVs / head step too
    from specfire.kernels import head as head_fused
    head_fused.set_catchup(None if v.get("catchup", True) else False)   # the head's prompt catch-up kernels
    if mtp is not None:
        mtp.prefix = v.get("catchup", True)             # a shorter last cycle takes the queued chain's drafts
    current.clear()
    current.update(v)


def measure(llm, ids, name: str, tokens: int, reps: int, cuda: bool, log: Log, nbytes, long: int) -> dict:
    from specfire import SamplingParams, SpecPolicy
    from specfire.runtime import spec

    trunk, mtp = llm.engine.trunk, llm.engine.drafters["mtp"]
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    pol = SpecPolicy("mtp", k=3)
    n0 = XSUM_COUNT.n if XSUM_COUNT else 0
    llm.generate(ids, warm, spec="off")
    llm.generate(ids, warm, spec=pol)
    xsum_launches = XSUM_COUNT.n - n0 if XSUM_COUNT else None   # prefill + the graphs' captures
    ar_s, cyc_s, ar_ids, eq, tau = [], [], None, True, 0.0
    for _ in range(reps):
        a = llm.generate(ids, sp, spec="off")
        m = llm.generate(ids, sp, spec=pol)
        ar_s.append(a.stats["decode_s"] / max(1, len(a.token_ids) - 1))
        cyc_s.append(m.stats["decode_s"] / max(1, m.stats["cycles"]))
        ar_ids = ar_ids or a.token_ids
        eq = eq and m.token_ids == a.token_ids == ar_ids
        tau = m.stats["mean_accept_len"]
    ar, cyc = statistics.median(ar_s), statistics.median(cyc_s)
    row = dict(variant=name, ar_step_ms=round(ar * 1e3, 3), ar_tok_s=round(1 / ar, 1),
               ar_of_ceiling=round(nbytes / ar / CEILING, 4), mtp3_cycle_ms=round(cyc * 1e3, 3),
               mtp3_tok_s=round(tau / cyc, 1), cycle_over_ar=round(cyc / ar, 4), tau=round(tau, 3),
               mtp_equals_ar=eq, ar_md5=md5(ar_ids), ar_runs_ms=[round(x * 1e3, 3) for x in ar_s],
               cycle_runs_ms=[round(x * 1e3, 3) for x in cyc_s], xsum_launches_warmup=xsum_launches)
    if cuda and trunk.graphs is not None:
        g = {f"rows{r}": round(_time_graph(gr.graph, 20) * 1e3, 3) for r, gr in sorted(trunk.graphs.graphs.items())}
        for key, gr in trunk.graphs.commits.items():
            g[f"commit{key[0]}_{key[1]}"] = round(_time_graph(gr, 20) * 1e3, 3)
        if mtp.graphs is not None:
            for key, gr in mtp.graphs.graphs.items():
                if key == (4, 3, "after"):
                    g["chain_after_4_3"] = round(_time_graph(gr, 20) * 1e3, 3)
        row["graphs_ms"] = g
        if "rows1" in g and "rows4" in g and "chain_after_4_3" in g:
            row["cycle_minus_rows4_chain_ms"] = round(row["mtp3_cycle_ms"] - g["rows4"] - g["chain_after_4_3"], 3)
            row["ar_minus_rows1_ms"] = round(row["ar_step_ms"] - g["rows1"], 3)
    # one instrumented MTP run: the cycle's phases on the device and the host
    ph = Phases(cuda)
    ph.wrap(trunk, "verify", lambda ids_, pos: f"verify{ids_.shape[0]}")
    ph.wrap(spec, "greedy_accept", "accept")
    ph.wrap(spec.StepBuffers, "send", "stage")
    ph.wrap(mtp, "prepare", "chain")
    ph.wrap(mtp, "propose", "propose")
    ph.wrap(trunk, "commit", "commit")
    ph.wrap(spec.Launched, "read", "read")
    try:
        ph.on = True
        llm.generate(ids, sp, spec=pol)
        ph.on = False
    finally:
        ph.undo()
    row["phases_us"] = ph.cycles(4)
    if long:
        lsp = SamplingParams(max_tokens=long, ignore_eos=True)
        a = llm.generate(ids, lsp, spec="off")
        m = llm.generate(ids, lsp, spec=pol)
        la = a.stats["decode_s"] / max(1, len(a.token_ids) - 1)
        lc = m.stats["decode_s"] / max(1, m.stats["cycles"])
        row["long"] = dict(tokens=long, ar_step_ms=round(la * 1e3, 3), ar_tok_s=round(1 / la, 1),
                           mtp3_cycle_ms=round(lc * 1e3, 3), cycle_over_ar=round(lc / la, 4),
                           mtp3_tok_s=round(m.stats["decode_tok_s"], 1), cycles=m.stats["cycles"],
                           mtp_equals_ar=m.token_ids == a.token_ids)
        prompt = torch.tensor(ids, device=trunk.device)
        ts = []
        for _ in range(3):
            trunk.begin()
            rows_ = trunk.prefill(prompt)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            mtp.begin(prompt, rows_.hidden)
            if cuda:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        row["head_prompt_catchup_ms"] = round(statistics.median(ts) * 1e3, 3)
    log("variant", **row)
    return row


def profile_rows(llm, ids, name: str, log: Log, rows: bool = True) -> None:
    """torch.profiler by kernel family over replays of the 1-row and the 4-row trunk graph (rows
    False: not those), and kernel by kernel over replays of the MTP draft chain's graph (k=3 after
    a 4-row verify)."""
    from specfire import SamplingParams, SpecPolicy

    trunk = llm.engine.trunk
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate(ids, warm, spec="off")
    llm.generate(ids, warm, spec=SpecPolicy("mtp", k=3))
    prof = {}
    for r in (1, 4):
        gr = trunk.graphs.graphs.get(r)
        if gr is not None and rows:
            prof[f"rows{r}"] = families(gr.graph.replay)
    mtp = llm.engine.drafters["mtp"]
    if mtp.graphs is not None and (4, 3, "after") in mtp.graphs.graphs:   # the chain after a 4-row verify
        prof["chain_after_4_3"] = families(mtp.graphs.graphs[(4, 3, "after")].replay, reps=8, top=60)
    log("profile", variant=name, **prof)


def random_head_check(llm, ids, tokens: int, log: Log, label: str) -> None:
    """Final norms +1 (a random head: drafts rejected, n = 0 mostly; the output now depends on the
    bits, where the tied checkpoint's is token 0 whatever they are): MTP k=3 == AR."""
    from specfire import SamplingParams, SpecPolicy
    from specfire.kernels.gdn import fused as gdn_fused
    from specfire.kernels.q4 import gemv as triton_quant

    model, head = llm.engine.trunk.model, llm.engine.drafters["mtp"].head
    saved = (model.norm.weight.clone(), head.norm.weight.clone())
    try:
        with torch.no_grad():
            model.norm.weight.fill_(1.0)
            head.norm.weight.fill_(1.0)
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
        a = llm.generate(ids, sp, spec="off")
        m = llm.generate(ids, sp, spec=SpecPolicy("mtp", k=3))
        log("random_head", weights=label, gdn=(gdn_fused.BV, gdn_fused.NUM_WARPS), pipe=gdn_fused.PIPE,
            merged=gdn_fused.MERGED, xsum_fold=os.environ.get("SPECFIRE_XSUM_FOLD", "plain"),
            q4_discard=triton_quant.DISCARD, q4_mtiles=len(triton_quant.M_TILES), q4_ilp=triton_quant.COMBINE_ILP,
            mtp_equals_ar=m.token_ids == a.token_ids,
            tau=m.stats["mean_accept_len"], accepted=m.stats["accepted"], cycles=m.stats["cycles"])
    finally:
        with torch.no_grad():
            model.norm.weight.copy_(saved[0])
            head.norm.weight.copy_(saved[1])


def kernel_check(cfg, device: str, log: Log) -> bool:
    """The GDN kernels' bits on cfg's GDN geometry (random bf16 projections, float32 state): see the
    module docstring. Returns whether every comparison held."""
    from specfire.kernels import gdn as gdn_ops
    from specfire.kernels.gdn.fused import gdn_decode_ref, gdn_decode_triton
    from specfire.kernels.gdn.kernel import commit_rows_triton, gdn_rows_triton

    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kk, t, c = cfg.linear_conv_kernel_dim, 4, 2 * hk * dk + hv * dv
    g = torch.Generator(device=device).manual_seed(11)

    def rnd(*shape, scale=1.0, dt=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    qkv, a, b, z = rnd(t, c), rnd(t, hv, scale=3.0), rnd(t, hv), rnd(t, hv * dv, scale=2.0)
    win, w, s = rnd(kk - 1, c, dt=torch.float32), rnd(c, kk, scale=0.5), rnd(hv, dk, dv, scale=0.3, dt=torch.float32)
    a_log, dtb, nw = rnd(hv, scale=0.5), rnd(hv), (1 + rnd(dv, scale=0.2, dt=torch.float32)).to(torch.bfloat16)

    def committed(s0, lg, rows):
        st = s0[None].clone()
        commit_rows_triton(st, *(x[None].contiguous() for x in lg), rows)
        return st[0]

    every = True
    forms = [(32, 2, False, False), (None, 4, False, False), (32, 2, True, False), (None, 4, True, False)]
    forms += [(bv, nwarps, True, True) for bv, nwarps in MERGED_CHECK]
    for bv, nwarps, pipe, merged in forms:
        o, lg, full = gdn_decode_triton(qkv, a, b, win, w, a_log, dtb, s, hk, dk, dv, z, nw, 1e-6,
                                        bv=bv, num_warps=nwarps, pipe=pipe, merged=merged)
        if pipe and not merged:   # the pipelined loop: the unpipelined one's bits (outputs, logs, window), 4 rows and 1
            o0, lg0, full0 = gdn_decode_triton(qkv, a, b, win, w, a_log, dtb, s, hk, dk, dv, z, nw, 1e-6,
                                               bv=bv, num_warps=nwarps, pipe=False, merged=False)
            o1, lg1, _ = gdn_decode_triton(qkv[:1], a[:1], b[:1], win, w, a_log, dtb, s, hk, dk, dv, z[:1], nw, 1e-6,
                                           bv=bv, num_warps=nwarps, pipe=True, merged=False)
            o10, lg10, _ = gdn_decode_triton(qkv[:1], a[:1], b[:1], win, w, a_log, dtb, s, hk, dk, dv, z[:1], nw,
                                             1e-6, bv=bv, num_warps=nwarps, pipe=False, merged=False)
            same = (torch.equal(o, o0) and torch.equal(full, full0) and torch.equal(o1, o10)
                    and all(torch.equal(x, y) for x, y in zip(lg + lg1, lg0 + lg10)))
            every &= same
            log("kernel_check", form=[bv, nwarps, "pipe"], pipe_equals_unpipelined=same, ok=same)
        rows_o = rows_log = state = True
        cur_s, cur_w = s.clone(), win
        for i in range(t):
            o1, l1, _ = gdn_decode_triton(qkv[i:i + 1], a[i:i + 1], b[i:i + 1], cur_w, w, a_log, dtb, cur_s,
                                          hk, dk, dv, z[i:i + 1], nw, 1e-6, bv=bv, num_warps=nwarps, pipe=pipe,
                                          merged=merged)
            rows_o &= torch.equal(o1[0], o[i])
            rows_log &= all(torch.equal(x[0], y[i]) for x, y in zip(l1, lg))
            cur_s, cur_w = committed(cur_s, l1, 1), full[i + 1:i + kk]
            state &= torch.equal(committed(s, lg, i + 1), cur_s)
        ro, rlg, _ = gdn_decode_ref(qkv, a, b, win, w, a_log, dtb, s, hk, dk, dv, z, nw, 1e-6)
        ref = s[None].clone()
        gdn_ops.commit_rows_ref(ref, *(x[None].contiguous() for x in rlg), t)
        diff = (committed(s, lg, t) - ref[0]).abs().max().item()
        ok = rows_o and rows_log and state
        every &= ok
        log("kernel_check", form=[bv, nwarps] + (["merged"] if merged else ["pipe"] if pipe else []), rows_equal_single_rows_o=rows_o, logs_equal=rows_log,
            commit_n_equals_single_rows=state, state_max_abs_diff_vs_reference=diff,
            o_max_abs_diff_vs_reference=(o.float() - ro.float()).abs().max().item(), ok=ok)
    # the unfused rows kernel: its own final state == its log replayed by the commit kernel
    q = torch.nn.functional.normalize(rnd(t, hv, dk, dt=torch.float32), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(rnd(t, hv, dk, dt=torch.float32), dim=-1)
    v, gg, beta = rnd(t, hv, dv, dt=torch.float32), -rnd(t, hv, dt=torch.float32).abs(), rnd(t, hv, dt=torch.float32).sigmoid()
    same = True
    for rows in range(1, t + 1):
        _, final = gdn_rows_triton(q[:rows], k[:rows], v[:rows], gg[:rows], beta[:rows], s)
        _, (delta, dec) = gdn_rows_triton(q, k, v, gg, beta, s, log=True)
        same &= torch.equal(committed(s, (k, delta, dec), rows), final)
    every &= same
    log("kernel_check", form="unfused rows kernel", final_state_equals_commit=same, ok=same)
    return every


def head_check(cfg, device: str, log: Log) -> bool:
    """The MTP head's fused rows step (kernels/head) on cfg's shapes: the fc-input kernel ==
    the two RMSNorm kernels over the gathered and the hidden rows, bit for bit (1 and 4 rows); the
    rotary table's rows == rope_cos_sin at those positions (single positions and 4-row runs); the
    fused q/k kernel reading the table == reading the gathered rows."""
    from specfire.model.qwen35 import positions
    from specfire.kernels import head as head_fused
    from specfire.kernels.head import kernel as head_kernel
    from specfire.kernels.small import kernel as ts
    from specfire.kernels.norm import kernel as nk
    from specfire.kernels.attention.fused import qk_norm_rope_write_triton
    from specfire.kernels.small import rope_cos_sin

    g = torch.Generator(device=device).manual_seed(5)
    h, bf = cfg.hidden_size, torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(bf)

    table, we, wh = rnd(1000, h, scale=0.05), rnd(h, scale=0.2), rnd(h, scale=0.2)
    fc_same = True
    for r in (1, 4):
        ids = torch.randint(0, 1000, (r,), generator=g, device=device)
        hid = rnd(r, h, scale=3.0)
        y = head_kernel.fc_input_triton(ids, table, hid, we, wh, cfg.rms_norm_eps, cfg.rms_norm_eps)
        ref = torch.cat([nk.rms_norm_triton(table[ids], we, cfg.rms_norm_eps),
                         nk.rms_norm_triton(hid, wh, cfg.rms_norm_eps)], -1)
        fc_same &= torch.equal(y, ref)
    n = 4096
    head_fused._TABLES.clear()
    cos, sin = head_fused.rope_table(torch.device(device), cfg.rotary_dim, cfg.rope_theta, n)
    rope_same = True
    for p in list(range(0, n - 4, 61)) + [n - 4]:
        for t in (1, 4):
            c, s_ = rope_cos_sin(positions(torch.tensor([p], device=device), t, device), cfg.rotary_dim, cfg.rope_theta)
            rope_same &= torch.equal(c, cos[p:p + t]) and torch.equal(s_, sin[p:p + t])
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qk_same = True
    for t in (1, 4):
        qg, kx, vx = rnd(t, hq, 2 * d), rnd(t, hkv, d), rnd(t, hkv, d)
        kc, vc = rnd(64, hkv, d), rnd(64, hkv, d)
        kc2, vc2 = kc.clone(), vc.clone()
        pos = torch.tensor([37], device=device)
        q = qk_norm_rope_write_triton(qg, kx, vx, we[:d], wh[:d], 1e-6, cos, sin, kc, vc, pos, table=True)
        q2 = qk_norm_rope_write_triton(qg, kx, vx, we[:d], wh[:d], 1e-6, cos[37:37 + t], sin[37:37 + t],
                                       kc2, vc2, pos)
        qk_same &= torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    pick_same = True                                    # the chain's pick == torch.argmax; select == index_select
    out = torch.zeros(3, dtype=torch.long, device=device)
    for i in range(6):
        lg = rnd(1, 32768 if i < 4 else 248320, scale=4.0)
        if i % 2:
            lg = lg.round()                                   # many ties
        tok, p = head_kernel.pick_triton(lg, out, i % 3, torch.tensor([9], device=device))
        pick_same &= bool(tok.item() == lg.argmax(-1).item() == lg.float().argmax(-1).item() and p.item() == 10)
    pre, post = rnd(4, h), rnd(4, h)
    for i in range(4):
        n = torch.tensor([i], device=device)
        a, b, p = head_kernel.select_triton(pre, post, n, torch.tensor([5], device=device))
        pick_same &= torch.equal(a, pre[i:i + 1]) and torch.equal(b, post[i:i + 1]) and p.item() == 5 + i
    ok = fc_same and rope_same and qk_same and pick_same
    log("head_check", fc_input_equals_norm_kernels=fc_same, rope_table_equals_rope_cos_sin=rope_same,
        qk_table_equals_gathered_rows=qk_same, pick_and_select_equal_torch=pick_same, ok=ok)
    return ok


def run_model(path: str, label: str, vocab: int | None, names: list[str], device: str, log: Log, args,
              nbytes, deadline: float) -> None:
    from specfire import LLM

    t0 = time.perf_counter()
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(0)
    with LLM(path, device=device, progress=False, max_seq_len=args.prompt + 2 * args.tokens + 64,
             draft_vocab=vocab) as llm:
        log("progress", what=label, loaded_s=round(time.perf_counter() - t0, 1))
        ids = torch.randint(0, llm.cfg.vocab_size - 1, (args.prompt,), generator=g).tolist()
        nb = nbytes(llm.cfg, args.prompt + args.tokens // 2)
        current: dict = {}
        for i, name in enumerate(names):
            if time.monotonic() > deadline:
                log("skipped", what=label, variant=name, why="time budget")
                continue
            t1 = time.monotonic()
            try:
                apply(llm, name, current)
                measure(llm, ids, name, args.tokens, args.reps, cuda, log, nb,
                        long=args.long if i < args.long_variants else 0)
                random_head_check(llm, ids, 32, log, label)
            except Exception as e:                 # one variant's failure must not cost the call the others
                import traceback
                log("error", what=label, variant=name, error=repr(e), tb=traceback.format_exc()[-2000:])
                current.clear()
            log("progress", what=label, variant=name, s=round(time.monotonic() - t1, 1))
        if cuda and args.profile:                  # last: the profiler slows the host's later launches
            seen, seen_rows = set(), set()
            for name in names:
                if args.profile_variants is not None and name not in args.profile_variants.split(","):
                    continue
                v = VARIANTS[name]
                key = (v["gdn"], v["pipe"], v.get("merged", False), v.get("q4"), v.get("fold"), v.get("chain", "1"),
                       v.get("pick", "1"))
                if key in seen or time.monotonic() > deadline:
                    continue
                seen.add(key)
                try:
                    apply(llm, name, current)
                    profile_rows(llm, ids, name, log, rows=key[:3] not in seen_rows)
                    seen_rows.add(key[:3])
                except Exception as e:
                    import traceback
                    log("error", what=label, variant=f"profile {name}", error=repr(e),
                        tb=traceback.format_exc()[-2000:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--vocab", type=int, default=32768, help="draft vocabulary (0: the whole one)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="AR and MTP runs per variant (median)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the kernel-family profiles")
    ap.add_argument("--long", type=int, default=160, help="tokens of the longer runs (0: none); must fit max_seq")
    ap.add_argument("--long-variants", type=int, default=2, help="how many of the first variants get --long runs")
    ap.add_argument("--variants", default="gdn32w2p,m32w2")
    ap.add_argument("--bf16-variants", default="m32w2",
                    help="variants of the bf16 model (after the 4-bit one)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what would start past this")
    ap.add_argument("--bf16-need-s", type=float, default=95, help="start the bf16 model only with this much left")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--profile-variants", default=None, help="comma list: profile only these (default: all)")
    ap.add_argument("--q4-mtiles", default=None, help="JSON of bench/q4_rows4.py --adopt: the q4mt / q4all tiles")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: the flow, no timings worth keeping")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    if args.q4_mtiles:
        import json
        with open(args.q4_mtiles) as f:
            Q4_MTILES.update({tuple(int(a) for a in key.split(",")): tuple(v) for key, v in json.load(f).items()})
    bnames = [v for v in args.bf16_variants.split(",") if v]
    for v in names + bnames:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
    t_end = time.monotonic() + args.budget_s
    device = "cpu" if args.smoke else "cuda"

    import tp_mtp
    from draft_vocab import tie_norms
    if args.smoke:
        import decode
        smoke_shapes()
        decode.SHAPES["tiny"] = {**decode.SHAPES["tiny"], "intermediate_size": 128}
        args.shape, args.prompt, args.tokens, args.vocab, args.reps, args.long = "tiny", 40, 12, 100, 1, 20
        tp_mtp.GROUP = 32
        torch.set_num_threads(1)
    if args.long and args.long > 2 * args.tokens + 56:
        raise SystemExit(f"--long {args.long} does not fit max_seq (prompt + 2 x --tokens + 64): "
                         f"at most {2 * args.tokens + 56}")
    from decode import make_cfg
    cfg = make_cfg(args.shape)
    log = Log(args.out, name="cycle_profile.jsonl")
    log("start", commit=args.commit, shape=args.shape, torch=torch.__version__, variants=names,
        xsum_fold_env=os.environ.get("SPECFIRE_XSUM_FOLD"),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu")
    vocab = args.vocab or None
    global XSUM_COUNT
    from specfire.kernels.q4 import gemv as triton_quant
    XSUM_COUNT = triton_quant._xsum_kernel = LaunchCount(triton_quant._xsum_kernel)
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        for check in (kernel_check, head_check):
            try:
                check(cfg, device, log)
            except Exception as e:
                import traceback
                log("error", what=check.__name__, error=repr(e), tb=traceback.format_exc()[-2000:])
    d = tempfile.mkdtemp(prefix="cycprof-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        t0 = time.perf_counter()
        tp_mtp.job_q4ckpt(cfg, d, device, log)
        tie_norms(os.path.join(d, "q4"), os.path.join(d, "q4tied"), cfg)
        log("progress", what="q4ckpt", s=round(time.perf_counter() - t0, 1))
        run_model(os.path.join(d, "q4tied"), "4-bit", vocab, names, device, log, args,
                  lambda c, ctx: tp_mtp.q4_step_bytes(c, d, 1, ctx), t_end - 15)
        shutil.rmtree(os.path.join(d, "q4tied"), ignore_errors=True)
        shutil.rmtree(os.path.join(d, "q4"), ignore_errors=True)
        left = t_end - time.monotonic()
        if bnames and left >= args.bf16_need_s:
            t0 = time.perf_counter()
            job_ckpt(cfg, d, device, log)
            shutil.rmtree(os.path.join(d, "normal"), ignore_errors=True)   # tied holds hard links to its shards
            log("progress", what="ckpt", s=round(time.perf_counter() - t0, 1))
            run_model(os.path.join(d, "tied"), "bf16", vocab, bnames, device, log, args,
                      lambda c, ctx: step_bytes(c, 1, ctx), t_end - 10)
        elif bnames:
            log("skipped", what="bf16", why=f"{left:.0f} s left, need {args.bf16_need_s:.0f}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    log("done", seconds=round(time.monotonic() - (t_end - args.budget_s), 1))


if __name__ == "__main__":
    main()
