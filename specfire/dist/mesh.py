"""The mesh: `tp` processes, one per device, each holding one shard of the trunk.

Rank 0 is the caller's process, the driver: it owns requests, the tokenizer, sampling, the route
selector and the drafters (the MTP head lives whole on rank 0), and it runs the same Engine and
`spec_step` as one device, over a `MeshTrunk`. Every Trunk call on rank 0 broadcasts a small
command; the workers run the same `RankExecutor.run` on their shards, so every rank executes the
same forward, the same per-row capture and the same `commit(n)`.

Launch: `LLM(model, tp=N)` spawns N-1 local workers (spawn start method); under `torchrun` (the
torch.distributed environment variables are set, several hosts included) every process calls
`LLM(...)`, rank 0 returns the driver and the other ranks serve until rank 0 closes, then exit.

Faults: the forward's collectives have a bounded timeout (SPECFIRE_TP_TIMEOUT seconds, default
60), rank 0 checks that its local workers are alive before every command, and the first failure
closes the mesh and raises MeshError naming the rank. Workers exit when their parent dies.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from ..config import ModelConfig
from ..errors import CheckpointError, MeshError, SpecfireError
from ..model import loader
from ..runtime.engine import Engine
from ..ops.linear import linear
from ..runtime.trunk import LocalTrunk, Rows
from . import comm as comm_mod
from .comm import Comm
from .model import ShardedQwen35
from .shard import ShardPlan, check_degree, quant_problem, valid_tp_degrees

log = logging.getLogger("specfire")

TIMEOUT_ENV = "SPECFIRE_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 1800.0          # starting interpreters and loading shards (bounded, but generous)
JOIN_S = 10.0                     # how long a closing worker may take before it is killed

# commands: [op, a, b, c]
BEGIN, PREFILL, VERIFY, COMMIT, SCORE, EMBED, LM_LOGITS, STATS, CLOSE = range(1, 10)
STAT_NAMES = ("begins", "prefills", "verifies", "verify_rows", "max_verify_rows", "commits", "embeds", "lm_logits")


def mesh_timeout() -> float:
    """The collective timeout in seconds (the one place the mesh reads its environment)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return v


@dataclass(frozen=True)
class MeshSpec:
    """Everything a rank needs to build its shard (pickled to spawned workers)."""

    path: str
    cfg: ModelConfig
    tp: int
    dtype: torch.dtype
    device_type: str
    device_base: int
    max_seq: int
    kv_dtype: torch.dtype
    timeout_s: float
    threads: int | None           # CPU threads per rank; None = leave as is

    def device(self, local_rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.device_base + local_rank)
        return torch.device(self.device_type)


def load_shard(spec: MeshSpec, comm: Comm) -> LocalTrunk:
    """This rank's trunk: build the sharded modules on meta, then read only this rank's slices."""
    src = loader.open_checkpoint(spec.path)
    plan = ShardPlan(spec.cfg, spec.tp, comm.rank)
    with torch.device("meta"):
        model = ShardedQwen35(spec.cfg, plan, comm)
    loader.load_module(model, src, "", dtype=spec.dtype, device=comm.device, fetch=plan.fetch,
                       what=f"trunk shard {comm.rank}/{spec.tp}")
    # Eager on every rank: the forward holds collectives, and capturing NCCL into a CUDA graph hung
    # on our GPU machine (shared/GPU.md); a capturable all-reduce comes first (docs/TENSOR_PARALLEL.md).
    return LocalTrunk(model, spec.max_seq, spec.kv_dtype, cuda_graphs=False)


# ---------------------------------------------------------------------------------------------
# What every rank does for one command
# ---------------------------------------------------------------------------------------------

class RankExecutor:
    """Runs one command on this rank's shard. Rank 0 passes the payload; the other ranks receive it
    through the broadcast here, so the same code path runs everywhere."""

    def __init__(self, comm: Comm, trunk: LocalTrunk, dtype: torch.dtype):
        self.comm, self.trunk, self.dtype = comm, trunk, dtype
        self.counts = dict.fromkeys(STAT_NAMES, 0)

    def _payload(self, payload: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if payload is None:
            payload = torch.empty(shape, dtype=dtype, device=self.comm.device)
        return self.comm.broadcast(payload.contiguous())

    @torch.inference_mode()
    def run(self, op: int, a: int, b: int, payload: torch.Tensor | None = None) -> Any:
        t, n = self.trunk, self.counts
        if op == BEGIN:
            n["begins"] += 1
            return t.begin()
        if op == COMMIT:
            n["commits"] += 1
            return t.commit(a)
        if op in (PREFILL, VERIFY, SCORE, EMBED):
            ids = self._payload(payload, (a,), torch.int64)
            if op == PREFILL:
                n["prefills"] += 1
                return t.prefill(ids)
            if op == VERIFY:
                n["verifies"] += 1
                n["verify_rows"] += a
                n["max_verify_rows"] = max(n["max_verify_rows"], a)
                return t.verify(ids, b)
            if op == SCORE:
                n["prefills"] += 1
                return t.score(ids)
            n["embeds"] += 1
            return t.embed(ids)
        if op == LM_LOGITS:
            n["lm_logits"] += 1
            h = self._payload(payload, (a, t.cfg.hidden_size), self.dtype)
            return t.lm_logits(h)
        if op == STATS:
            mine = torch.tensor([[n[k] for k in STAT_NAMES]], dtype=torch.int64, device=self.comm.device)
            return self.comm.gather(mine, dim=0)
        raise MeshError(f"unknown mesh command {op}")


def serve(comm: Comm, trunk: LocalTrunk, dtype: torch.dtype) -> None:
    """A worker's loop: run rank 0's commands until CLOSE."""
    ex = RankExecutor(comm, trunk, dtype)
    while True:
        op, a, b, _ = comm.recv_command()
        if op == CLOSE:
            return
        ex.run(op, a, b)


def run_worker(comm: Comm, spec: MeshSpec, created: bool, report=None) -> int:
    """Load this worker's shard, tell every rank whether that worked, serve, free. Returns an exit code."""
    trunk = None
    try:
        trunk = load_shard(spec, comm)
    except Exception as e:  # reported to rank 0, which raises it
        if report is not None:
            report(("error", type(e).__name__, str(e)))
        print(f"specfire: tp rank {comm.rank}: {e}", file=sys.stderr)
    code = 0
    try:
        if all(comm.exchange_flags(int(trunk is not None))):
            serve(comm, trunk, spec.dtype)
        else:
            code = 1
    except Exception as e:  # rank 0 went away or a peer failed: nothing to serve any more
        print(f"specfire: tp rank {comm.rank}: mesh lost ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
              file=sys.stderr)
        code = 1
    if trunk is not None:
        trunk.close()
    comm_mod.shutdown(comm, created)
    return code


def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives the process that started it."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="specfire-parent-watch").start()


def worker_main(conn: Connection, parent_pid: int) -> int:
    """A local worker (`python -m specfire.dist.worker`): receive (rank, spec, init_method), say
    hello, join the group, serve. Returns the exit code."""
    _exit_with_parent(parent_pid)
    rank, spec, init_method = conn.recv()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    conn.send(("hello",))
    comm, created = comm_mod.init(rank, spec.tp, spec.device(rank), spec.timeout_s, init_method, START_TIMEOUT_S)
    code = run_worker(comm, spec, created, report=conn.send)
    conn.close()
    return code


class LocalWorker:
    """One worker process started by rank 0. A fresh interpreter (not multiprocessing's spawn, which
    re-imports the caller's __main__), with a private pipe for start-up messages."""

    def __init__(self, rank: int, spec: "MeshSpec", init_method: str):
        self.rank = rank
        ours, theirs = Pipe(duplex=True)
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specfire.dist.worker", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = ours
        self.conn.send((rank, spec, init_method))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()
        self.join(5.0)

    def close(self) -> None:
        self.conn.close()


# ---------------------------------------------------------------------------------------------
# Rank 0: the mesh handle (lifecycle) and the trunk
# ---------------------------------------------------------------------------------------------

class _Mesh:
    """Processes and groups of one mesh; tears them down exactly once. Holds no reference to the
    trunk, so it can be the trunk's finalizer."""

    def __init__(self, comm: Comm, created: bool, workers: list[LocalWorker], store: str | None,
                 threads_before: int | None, timeout_s: float):
        self.comm, self.created = comm, created
        self.timeout_s = timeout_s
        self.workers = workers
        self.store = store
        self.threads_before = threads_before
        self.error: str | None = None
        self.closed = False

    def check(self) -> None:
        if self.error is not None:
            raise MeshError(f"the tensor-parallel mesh failed earlier and is closed: {self.error}")
        if self.closed:
            raise SpecfireError("this LLM has been closed")
        for w in self.workers:
            if not w.is_alive():
                raise self.fail(None)

    def fail(self, exc: BaseException | None) -> MeshError:
        """Name what went wrong, close the mesh, return the error to raise."""
        deadline = time.monotonic() + 1.0     # a killed worker may need a moment to be reaped
        dead = []
        while True:
            dead = [w for w in self.workers if not w.is_alive()]
            if dead or time.monotonic() > deadline or exc is None:
                break
            time.sleep(0.02)
        if dead:
            w = dead[0]
            msg = f"tensor-parallel worker rank {w.rank} (pid {w.pid}) died with exit code {w.exitcode}"
        elif exc is not None and ("timed out" in str(exc).lower() or "timeout" in str(exc).lower()):
            msg = (f"a tensor-parallel rank did not answer within {self.timeout_s:g} s "
                   f"({TIMEOUT_ENV}); it is hung or too slow")
        else:
            first = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else type(exc).__name__
            msg = f"a tensor-parallel collective failed: {first}"
        self.error = msg
        self.teardown(graceful=False)
        return MeshError(msg)

    def shutdown(self) -> None:
        """close(), garbage collection and interpreter exit all end here."""
        if not self.closed:
            self.teardown(graceful=self.error is None)

    def teardown(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.comm.send_command(CLOSE)
            except Exception:
                graceful = False
        for w in self.workers:
            w.join(JOIN_S if graceful else 0.0)
            w.kill()
            w.close()
        comm_mod.shutdown(self.comm, self.created)
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
        if self.store is not None and os.path.exists(self.store):
            os.unlink(self.store)


class MeshTrunk:
    """The Trunk interface over the mesh (rank 0). Same results as LocalTrunk: hidden rows are
    replicated on every rank, logits are gathered to rank 0."""

    def __init__(self, mesh: _Mesh, trunk: LocalTrunk, tp: int, dtype: torch.dtype,
                 drafter_vocab: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.cfg: ModelConfig = trunk.cfg
        self.max_seq = trunk.max_seq
        self.device = trunk.device
        self.tp = tp
        self._mesh = mesh
        self._local: LocalTrunk | None = trunk
        self._ex = RankExecutor(mesh.comm, trunk, dtype)
        self._dtype = dtype
        self._drafter_vocab = drafter_vocab     # whole (embedding, lm_head) on rank 0, or None
        self._finalizer = weakref.finalize(self, mesh.shutdown)

    def _do(self, op: int, a: int = 0, b: int = 0, payload: torch.Tensor | None = None) -> Any:
        self._mesh.check()
        try:
            self._mesh.comm.send_command(op, a, b)
            return self._ex.run(op, a, b, payload)
        except MeshError:
            raise
        except Exception as e:
            raise self._mesh.fail(e) from None
        except BaseException as e:  # e.g. KeyboardInterrupt mid-collective: the ranks are out of step
            self._mesh.fail(e)
            raise

    # ---- Trunk ---------------------------------------------------------------------------------
    def begin(self) -> None:
        self._do(BEGIN)

    def prefill(self, ids: torch.Tensor) -> Rows:
        return self._do(PREFILL, ids.shape[0], 0, ids)

    def verify(self, ids: torch.Tensor, pos: int) -> Rows:
        return self._do(VERIFY, ids.shape[0], pos, ids)

    def commit(self, n: int) -> None:
        self._do(COMMIT, n)

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        return self._do(SCORE, ids.shape[0], 0, ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._drafter_vocab is not None:
            return F.embedding(ids, self._drafter_vocab[0])
        return self.mesh_embed(ids)

    def lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self._drafter_vocab is not None:
            return linear(h, self._drafter_vocab[1], rows=True).float()
        return self.mesh_lm_logits(h)

    def mesh_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel embedding across the mesh (masked lookup + all-reduce)."""
        return self._do(EMBED, ids.shape[0], 0, ids)

    def mesh_lm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The vocab-parallel lm_head across the mesh (each rank 1/tp of the rows, gathered)."""
        return self._do(LM_LOGITS, h.shape[0], 0, h.to(self._dtype))

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._local = self._ex = self._drafter_vocab = None  # type: ignore[assignment]
        self._finalizer()

    # ---- inspection ----------------------------------------------------------------------------
    def rank_stats(self) -> list[dict[str, int]]:
        """Per-rank command counters (every rank must have run exactly what rank 0 ran)."""
        table = self._do(STATS)
        return [dict(zip(STAT_NAMES, row)) for row in table.tolist()]

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._mesh.workers]

    @property
    def closed(self) -> bool:
        return self._mesh.closed


# ---------------------------------------------------------------------------------------------
# Building the mesh
# ---------------------------------------------------------------------------------------------

_open_meshes: "weakref.WeakSet[MeshTrunk]" = weakref.WeakSet()


def _launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _start_local_workers(spec: MeshSpec, store: str) -> list[LocalWorker]:
    """Start ranks 1..tp-1 and wait until each has imported (a crash at start surfaces now)."""
    workers = [LocalWorker(r, spec, "file://" + store) for r in range(1, spec.tp)]
    deadline = time.monotonic() + START_TIMEOUT_S
    for w in workers:
        try:
            while not w.conn.poll(0.05):
                if not w.is_alive() or time.monotonic() > deadline:
                    raise EOFError
            w.conn.recv()
        except (EOFError, OSError):
            why = (f"exited with code {w.exitcode}" if not w.is_alive()
                   else f"did not start within {START_TIMEOUT_S:g} s")
            _kill(workers)
            raise MeshError(f"tensor-parallel worker rank {w.rank} {why} while starting") from None
    return workers


def _kill(workers: list[LocalWorker]) -> None:
    for w in workers:
        w.kill()
        w.close()


def _worker_errors(workers: list[LocalWorker]) -> list[tuple[str, str]]:
    """(error type, message) of every worker that reported a load failure."""
    out = []
    for w in workers:
        try:
            if w.conn.poll(2.0):
                _, name, msg = w.conn.recv()
                out.append((name, f"rank {w.rank}: {msg}"))
        except (EOFError, OSError, ValueError):
            pass
    return out


def _drafter_vocab(src: loader.TensorSource, cfg: ModelConfig, head, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the MTP drafter's embedding and lm_head calls run. On the CPU a whole copy on rank 0
    (a gloo round trip costs milliseconds, the whole lm_head a tenth of one: docs/BENCHMARKS.md);
    on the GPU through the mesh (each rank reads 1/tp of the largest matrix, for one small
    collective, and rank 0 holds no extra copy). None without an MTP head."""
    if head is None or device.type != "cpu":
        return None
    emb = src.get("embed_tokens.weight").to(device=device, dtype=dtype)
    lm = emb if cfg.tie_word_embeddings else src.get("lm_head.weight").to(device=device, dtype=dtype)
    return emb, lm


def build_mesh_engine(llm, want_mtp: str, mtp_path: str | None = None) -> Engine:
    """Start (or join) the mesh for `llm` (an api.LLM with tp > 1) and return its Engine.

    The degree is checked and the MTP head loaded (rank 0 only, by the load-time policy) before any
    process starts, so a refused degree or a missing head never leaves processes behind."""
    from ..api import follow_tied, load_mtp_head

    tp = llm.tp
    check_degree(llm.cfg, tp)
    if any(not m.closed for m in _open_meshes):
        raise SpecfireError("a tensor-parallel LLM is already open in this process; close it first")
    timeout_s = mesh_timeout()
    src = loader.open_checkpoint(llm.path)
    why = quant_problem(llm.cfg, tp, src)   # 4-bit: column shards must fall on quantization groups
    if why is not None:
        ok = [d for d in valid_tp_degrees(llm.cfg) if quant_problem(llm.cfg, d, src) is None]
        raise CheckpointError(f"{llm.path}: {why}; tp degrees this 4-bit checkpoint allows: {', '.join(map(str, ok))}")
    cfg = follow_tied(src, llm.cfg)
    llm.cfg = cfg
    joined = _launched_by_torchrun()
    if joined:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if world != tp:
            raise ValueError(f"tp={tp} but the torch.distributed launch has WORLD_SIZE={world}; they must match")
    else:
        rank, local_rank = 0, 0
    base = (llm.device.index or 0) - (local_rank if joined else 0) if llm.device.type == "cuda" else 0
    threads = None if joined or llm.device.type != "cpu" else max(1, (os.cpu_count() or 1) // tp)
    spec = MeshSpec(path=llm.path, cfg=cfg, tp=tp, dtype=llm.dtype, device_type=llm.device.type,
                    device_base=max(0, base), max_seq=llm.max_seq_len, kv_dtype=llm.kv_dtype,
                    timeout_s=timeout_s, threads=threads)
    if joined and rank != 0:
        comm, created = comm_mod.init(rank, tp, spec.device(local_rank), timeout_s, None, START_TIMEOUT_S)
        sys.exit(run_worker(comm, spec, created))

    head = load_mtp_head(llm.path, src, cfg, llm.dtype, spec.device(local_rank), want_mtp, mtp_path)
    store = None
    workers: list[LocalWorker] = []
    threads_before = None
    if not joined:
        fd, store = tempfile.mkstemp(prefix="specfire-mesh-")
        os.close(fd)
        os.unlink(store)
        workers = _start_local_workers(spec, store)
    try:
        comm, created = comm_mod.init(0, tp, spec.device(local_rank), timeout_s,
                                      None if joined else "file://" + store, START_TIMEOUT_S)
    except Exception as e:
        _kill(workers)
        raise MeshError(f"the tensor-parallel mesh could not form: {str(e).splitlines()[0] if str(e) else e!r}") from None
    if threads is not None:
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
    mesh = _Mesh(comm, created, workers, store, threads_before, timeout_s)
    trunk, err = None, None
    try:
        trunk = load_shard(spec, comm)
    except Exception as e:
        err = e
    try:
        flags = comm.exchange_flags(int(trunk is not None))
    except Exception as e:
        raise mesh.fail(e) from None
    if not all(flags):
        worker_errs = _worker_errors(workers)
        mesh.teardown(graceful=False)
        if err is not None:
            raise err
        bad = [r for r, f in enumerate(flags) if not f]
        name, msg = worker_errs[0] if worker_errs else ("", f"rank {bad[0]} failed to load its shard (see its log)")
        raise (CheckpointError if name in ("CheckpointError", "ConfigError") else MeshError)(msg)
    mt = MeshTrunk(mesh, trunk, tp, llm.dtype, _drafter_vocab(src, cfg, head, llm.dtype, spec.device(local_rank)))
    _open_meshes.add(mt)
    log.info("tensor-parallel mesh of %d ranks ready (%s)", tp, "joined" if joined else "local workers")
    return Engine(mt, llm.tokenizer, llm.eos_ids, head, llm.kv_dtype, topology=f"tp{tp}", ngram=llm.ngram)
