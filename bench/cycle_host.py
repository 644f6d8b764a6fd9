"""The host path of one speculative cycle: where rank 0's host time goes between reading a verify's
result and issuing the next verify, and how late the other ranks learn of that verify.

    PYTHONPATH=$PWD python bench/cycle_host.py                       # CPU, tiny model, tp 1 and 2 (gloo)
    PYTHONPATH=$PWD python bench/cycle_host.py --emulate             # CPU, the GPU's flow (chain queued by
                                                                     #   prepare, head sharded, emulated graphs)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=$PWD python bench/cycle_host.py --device cuda --shape 27B --tp 2 --tokens 64 --prompt 512 --out $OUT

Greedy MTP k (default 3) through `LLM.generate`. Rank 0's phases are timed with perf_counter_ns by
wrapping the step's functions (the wrappers cost ~1 us each); a worker writes its own command
timeline (SPECFIRE_HOSTCLOCK, parallel/control.py), on the same clock. Per cycle (one read's end
to the next's), medians in microseconds:

  read        Launched.read (GPU: read.wait = the event wait for the device, the rest is the copy-out)
  commit      trunk.commit(n) (the live recurrent state := after row n; .local: rank 0's own trunk; check:
              the mesh's liveness check, before every call and commit)     drafter_commit   MtpDrafter.commit
  propose     MtpDrafter.propose (CPU: the chain runs here; GPU/--emulate: returns the queued chain)
  verify      trunk.verify: .header (the call built), .send (the command broadcast), .forward (rank 0's rows)
  accept      greedy accept            stage   the (n, targets) copy queued for the host
  prepare     the next chain queued: .chain (the chain's graph replayed); draft_cmd: the peers told of a chain
  other       the rest of the window (the engine's bookkeeping, text)
  issue       from the read's end to rank 0's next verify forward starting: the host path that matters;
              path.X: phase X's share of it, path.untimed: the engine's own code between the phases
  peer_recv   rank 0 starting to send the verify header -> rank 1 holding it
  peer_run    from rank 0's read end to rank 1 starting that verify (riders such as commit(n) run first);
              peer_done: to rank 1's verify call returning (GPU: its graph launched); peer_idle: rank 1
              waiting for that header
  dev.verify, dev.gap (CUDA): rank 0's verify on the device, and the device time from one verify's
              end to the next one's start (chain, accept, commit, or idle waiting for the host)

Without --shape: the tests' tiny Qwen3.5 (tests/tinymodels.py, 256 wide, 8 layers, random weights)
or --model bundled|PATH. With --shape (bench/decode.py's shapes): random weights whose final norms
tie every logit, so every draft is accepted (bench/tp.py's "tied" checkpoint). One JSON line per tp
on stdout and in OUT/cycle_host.jsonl; --profile prints rank 0's cProfile of the measured run;
--commit-cost times `SequenceState.commit` alone (the logged rows replayed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=4096)
MISSING = object()
TOP = ("read", "commit", "drafter_commit", "propose", "verify", "accept", "stage", "prepare")


class Patches:
    """Attributes replaced on objects or classes, put back by `undo` (in reverse order)."""

    def __init__(self):
        self._undo: list = []

    def _patch(self, owner, attr: str, new) -> None:
        self._undo.append((owner, attr, vars(owner).get(attr, MISSING)))
        setattr(owner, attr, new)

    def undo(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            if orig is MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
        self._undo.clear()


class Clock(Patches):
    """Spans (label, depth, t0, t1) of wrapped calls while `on`."""

    def __init__(self):
        super().__init__()
        self.spans: list[tuple[str, int, int, int]] = []
        self.sends: list[tuple[str, int, int]] = []
        self.events: list = []
        self.on = False
        self.depth = 0

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        now, clock = time.perf_counter_ns, self

        def timed(*a, **kw):
            if not clock.on:
                return fn(*a, **kw)
            d = clock.depth
            clock.depth = d + 1
            t0 = now()
            try:
                return fn(*a, **kw)
            finally:
                clock.spans.append((label, d, t0, now()))
                clock.depth = d
        self._patch(owner, attr, timed)

    def wrap_events(self, owner, attr: str) -> None:
        """CUDA: timing events around each call's device work (where the device starts and ends it)."""
        fn, clock = getattr(owner, attr), self

        def timed(*a, **kw):
            if not clock.on:
                return fn(*a, **kw)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            try:
                return fn(*a, **kw)
            finally:
                e1.record()
                clock.events.append((e0, e1))
        self._patch(owner, attr, timed)

    def device(self) -> dict:
        """Medians (us) of each verify's device time and of the device's gap from one verify's end
        to the next one's start (the chain, accept and commit run there, or the device idles)."""
        if not self.events:
            return {}
        torch.cuda.synchronize()
        ver = [a.elapsed_time(b) * 1e3 for a, b in self.events]
        gap = [b.elapsed_time(a2) * 1e3 for (_, b), (a2, _) in zip(self.events, self.events[1:])]
        return {"dev.verify": round(statistics.median(ver), 1), "dev.gap": round(statistics.median(gap), 1)}

    def wrap_send(self, comm) -> None:
        """Every command rank 0 broadcasts (its name and times), to match the workers' timelines."""
        from specfire.parallel.control import Call

        fn, now, clock = comm.send_command, time.perf_counter_ns, self

        def send(header: bytes) -> None:
            t0 = now()
            try:
                return fn(header)
            finally:
                t1 = now()
                name = Call.parse(header).name
                clock.sends.append((name, t0, t1))
                if clock.on:
                    clock.spans.append(("verify.send" if name == "verify" else f"send.{name}", clock.depth, t0, t1))
        self._patch(comm, "send_command", send)


def instrument(llm, clock: Clock) -> None:
    from specfire.runtime import spec
    from specfire.runtime.graphs import DraftGraphs

    trunk = llm.engine.trunk
    drafter = llm.engine.drafters["mtp"]
    clock.wrap(spec.Launched, "read", "read")
    if torch.cuda.is_available():
        clock.wrap(torch.cuda.Event, "synchronize", "read.wait")
    clock.wrap(trunk, "commit", "commit")
    clock.wrap(drafter, "commit", "drafter_commit")
    clock.wrap(drafter, "propose", "propose")
    clock.wrap(drafter, "prepare", "prepare")
    clock.wrap(trunk, "verify", "verify")
    clock.wrap(spec, "greedy_accept", "accept")
    clock.wrap(spec.StepBuffers, "send", "stage")
    clock.wrap(DraftGraphs, "draft_after", "prepare.chain")
    local = getattr(trunk, "_local", None)
    if llm.engine.trunk.device.type == "cuda":
        clock.wrap_events(local if local is not None else trunk, "verify")
    if local is not None:                     # a mesh: rank 0's own side of each call
        clock.wrap(trunk, "_header", "verify.header")
        clock.wrap(trunk, "draft_rounds", "draft_cmd")
        clock.wrap(local, "verify", "verify.forward")
        clock.wrap(local, "commit", "commit.local")
        clock.wrap(trunk._mesh, "check", "check")
        clock.wrap_send(trunk._mesh.comm)
    else:
        clock.wrap(trunk, "verify", "verify.forward")   # the same call: forward == verify on one device


def cycles(spans: list, peer: list[dict] | None) -> dict:
    """Per-cycle medians (us) of every label, `other`, `issue`, and the peer's latencies."""
    reads = sorted(t1 for lab, d, t0, t1 in spans if lab == "read")
    per: list[dict[str, float]] = []
    for a, b in zip(reads, reads[1:]):
        inside = [s for s in spans if a <= s[2] < b]
        tot: dict[str, float] = {}
        for lab, d, t0, t1 in inside:
            tot[lab] = tot.get(lab, 0.0) + (t1 - t0) / 1e3
        top = sum(v for k, v in tot.items() if k in TOP and k != "read")
        read_next = [s for s in spans if s[0] == "read" and s[3] == b]
        rd = (read_next[0][3] - read_next[0][2]) / 1e3 if read_next else 0.0
        tot["read"] = rd
        tot["other"] = (b - a) / 1e3 - top - rd
        tot["cycle"] = (b - a) / 1e3
        fw = [t0 for lab, d, t0, t1 in inside if lab == "verify.forward"]
        if fw:
            f0 = min(fw)
            tot["issue"] = (f0 - a) / 1e3
            covered = 0.0
            for lab, d, t0, t1 in inside:            # the issue path alone, phase by phase
                if t0 < f0 and lab != "verify.forward":
                    v = (min(t1, f0) - t0) / 1e3
                    tot[f"path.{lab}"] = tot.get(f"path.{lab}", 0.0) + v
                    covered += v if d == 0 else 0.0
            tot["path.untimed"] = tot["issue"] - covered
        if peer:
            vs = [p for p in peer if p["name"] == "verify" and a <= p["sent0"] < b]
            if vs:
                tot["peer_recv"] = (vs[0]["recv"] - vs[0]["sent0"]) / 1e3
                tot["peer_run"] = (vs[0]["run"] - a) / 1e3
                tot["peer_done"] = (vs[0]["done"] - a) / 1e3
                tot["peer_idle"] = (vs[0]["recv"] - vs[0]["wait"]) / 1e3
        per.append(tot)
    keys = sorted({k for t in per for k in t})              # a phase absent from a cycle counts 0 there
    return {k: round(statistics.median(t.get(k, 0.0) for t in per), 1) for k in keys} | {"cycles": len(per)}


def peer_timeline(clock: Clock, prefix: str, rank: int = 1) -> list[dict] | None:
    path = f"{prefix}.rank{rank}.json"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = json.load(f)
    sends = clock.sends
    rows = rows[-len(sends):]
    if [r[0] for r in rows] != [s[0] for s in sends]:
        raise SystemExit(f"rank {rank}'s command timeline does not match rank 0's sends")
    return [dict(name=s[0], sent0=s[1], sent1=s[2], wait=r[2], recv=r[3], run=r[5], done=r[6]) for s, r in zip(sends, rows)]


def checkpoint(args) -> tuple[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    if args.shape:
        import tp as tpb
        if args.shape == "tiny":
            tpb.smoke_shapes()
        from decode import make_cfg
        cfg = make_cfg(args.shape)
        d = tempfile.mkdtemp(prefix="cyclehost-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        tpb.job_ckpt(cfg, d, args.device, tpb.Log(None, "ckpt"))
        return os.path.join(d, "tied"), torch.randint(0, cfg.vocab_size - 1, (args.prompt,), generator=g).tolist()
    if args.model:
        return (None if args.model == "bundled" else args.model), "Once upon a time there was a little robot who"
    from tinymodels import make_checkpoint
    path = make_checkpoint(os.path.join(tempfile.mkdtemp(prefix="cyclehost-"), "m"), "base", seed=3, **SHAPE)
    ids = torch.randint(0, SHAPE["vocab_size"] - 1, (args.prompt,), generator=g).tolist()
    return path, ids + ids[:args.prompt // 2]


def run_tp(path, ids, tp: int, args) -> dict:
    from specfire import LLM, SamplingParams, SpecPolicy
    from specfire.runtime.graphs import DraftGraphs

    prefix = os.path.join(tempfile.mkdtemp(prefix="hostclock-"), "clock")
    os.environ["SPECFIRE_HOSTCLOCK"] = prefix
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    policy = SpecPolicy("mtp", k=args.k)
    clock = Clock()
    row: dict = dict(tp=tp, k=args.k, device=args.device, shape=args.shape or args.model or "tiny",
                     emulate=args.emulate, threads=torch.get_num_threads(), commit=args.commit,
                     load=round(os.getloadavg()[0], 2))
    llm = LLM(path, tp=tp, device=args.device, progress=False, max_seq_len=len(ids) + 2 * args.tokens + 64)
    try:
        drafter = llm.engine.drafters["mtp"]
        if args.emulate:                       # the GPU's flow on the CPU: chain queued by prepare, replayed
            drafter.graphs = DraftGraphs(drafter._chain_for, drafter.head.fc.weight.device, emulate=True)
            if tp > 1:
                llm.engine.trunk.draft_sharded = True      # the GPU mesh's picks
        instrument(llm, clock)
        ar = llm.generate(ids, sp, spec="off")
        llm.generate(ids, sp, spec=policy)     # warm-up (graph captures)
        prof = None
        if args.profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        clock.on = True
        res = llm.generate(ids, sp, spec=policy)
        clock.on = False
        if prof is not None:
            import pstats
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        row.update(tau=round(res.stats["mean_accept_len"], 3), equals_ar=res.token_ids == ar.token_ids,
                   decode_tok_s=round(res.stats["decode_tok_s"], 2))
    finally:
        llm.close()
        clock.undo()
    row["us"] = cycles(clock.spans, peer_timeline(clock, prefix) if tp > 1 else None) | clock.device()
    return row


def commit_cost(reps: int = 400) -> None:
    """SequenceState.commit alone (rows 0..n of a 4-row log replayed on the live state), at the GDN
    geometry of the tiny model and of the bundled one; per n, min and median us over reps / 4."""
    from specfire.config import FULL, LINEAR, ModelConfig
    from specfire.model.state import SequenceState

    for name, (hv, dk, layers) in {"tiny 8x32x32, 6 GDN layers": (8, 32, 8),
                                   "bundled 4x64x64, 9 GDN layers": (4, 64, 12)}.items():
        types = tuple(FULL if i % 4 == 3 else LINEAR for i in range(layers))
        cfg = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=32, num_hidden_layers=layers,
                          layer_types=types, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                          linear_num_key_heads=hv // 2, linear_num_value_heads=hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dk)
        row = dict(state=name, load=round(os.getloadavg()[0], 2), threads=torch.get_num_threads())
        st = SequenceState.allocate(cfg, types, 8, torch.device("cpu"), torch.float32)
        ts: dict[int, list[int]] = {n: [] for n in range(4)}
        for i in range(reps):
            with torch.inference_mode():              # a 4-row verify's log, as a forward leaves it
                for lc in st.layers:
                    if lc.rec is not None:
                        lc.rec.uniform_(-0.1, 0.1)
                        lc.set_log(torch.randn(4, hv, dk), torch.randn(4, hv, dk), torch.rand(4, hv),
                                   torch.randn(lc.conv.shape[0] + 4, lc.conv.shape[1]))
            t0 = time.perf_counter_ns()
            st.commit(i % 4)
            ts[i % 4].append(time.perf_counter_ns() - t0)
        row["commit_us_min"] = {n: round(min(v) / 1e3, 1) for n, v in ts.items()}
        row["commit_us_median"] = {n: round(statistics.median(v) / 1e3, 1) for n, v in ts.items()}
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="bench/decode.py shape (tied random weights); 'tiny' on the CPU")
    ap.add_argument("--model", default=None, help="'bundled' or a checkpoint path (default: the tests' tiny model)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--emulate", action="store_true", help="CPU: the GPU's draft flow (sharded picks, emulated graphs)")
    ap.add_argument("--profile", type=int, default=0, help="print rank 0's top N functions (cProfile, tottime)")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads of rank 0 (a mesh gives each rank cores // tp)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--commit-cost", action="store_true", help="only time SequenceState.commit (the logged rows replayed)")
    args = ap.parse_args()
    if args.commit_cost:
        torch.set_num_threads(args.threads)
        return commit_cost()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)      # spinning threads on a shared CPU would swamp the host times
    path, ids = checkpoint(args)
    for tp in args.tp:
        row = run_tp(path, ids, tp, args)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "cycle_host.jsonl"), "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
