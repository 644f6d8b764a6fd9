"""One rank's life: load its shard, tell every rank whether that worked, serve rank 0's calls, free.

`python -m specfire.parallel.worker FD PARENT_PID` is a local worker started by rank 0; a
torchrun rank other than 0 runs `run_worker` from inside `LLM(...)`.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch

from ..model import loader
from ..model.kvpool import KvPool
from ..runtime.slots import block_bytes, pool_blocks
from ..runtime.trunk import LocalTrunk
from . import comm as comm_mod
from .comm import Comm
from .control import ROWS_MAX, serve
from .draft import coll_bytes
from .launch import START_TIMEOUT_S, MeshSpec
from .model import ShardedQwen35
from .shard import ShardPlan


def load_shard(spec: MeshSpec, comm: Comm, head_heads: list[int] = ()) -> LocalTrunk:
    """This rank's trunk: the one loading path (model/loader.py) with the sharded model and a fetch
    that reads only this rank's slices; its slots' KV in one pool of this rank's heads, sized by
    the budget (per rank) as on one device (`agree_pool` then makes every rank's pool alike).
    `head_heads`: rank 0's MTP head's KV heads (whole, unsharded), its layers after the trunk's."""
    src = loader.open_checkpoint(spec.path)
    plan = ShardPlan(spec.cfg, spec.tp, comm.rank)
    model = loader.load_trunk(src, spec.cfg, dtype=spec.dtype, device=comm.device,
                              build=lambda cfg: ShardedQwen35(cfg, plan, comm), fetch=plan.fetch,
                              what=f"trunk shard {comm.rank}/{spec.tp}")
    graphs = spec.cuda_graphs if spec.device_type == "cuda" else False
    model.draft_vocab = spec.draft_vocab       # what this rank's side of a draft pick scores (parallel/draft.py)
    heads = model.kv_heads() + list(head_heads)
    blocks = pool_blocks(block_bytes(heads, spec.cfg.head_dim, spec.kv_dtype), spec.max_seq, spec.max_num_seqs,
                         spec.kv_budget, comm.device)
    pool = KvPool(heads, spec.cfg.head_dim, blocks, comm.device, spec.kv_dtype)
    trunk = LocalTrunk(model, spec.max_seq, spec.kv_dtype, cuda_graphs=graphs, kv_pool=pool)
    if trunk.graphs_enabled or spec.device_type == "cpu":
        # the rows forward's collectives: symmetric memory (capturable) on CUDA, the same code over
        # gloo on the CPU; sized for ROWS_MAX rows of logits or hidden per rank
        h, vs = spec.cfg.hidden_size, plan.vocab_shard
        comm.enable_graphs(4 * ROWS_MAX * spec.tp * max(vs, h), draft_bytes=coll_bytes(h, spec.tp))
    return trunk


def agree_pool(comm: Comm, trunk: LocalTrunk | None, ahead: int = 0) -> list[int]:
    """Every rank's flag after loading (its pool's blocks; 0: the load failed), exchanged; when
    all loaded, every pool hands out the smallest one's blocks only (a GPU's free memory, or rank
    0's bigger blocks holding the MTP head's KV too, may size them apart), and every rank's slots
    grow rank 0's `ahead` positions past their rows (the head's reach over the slot's table), so
    the ranks' block tables stay alike."""
    flags = comm.exchange_flags(trunk.kv_pool.num_blocks if trunk is not None else 0)
    if all(flags):
        trunk.kv_pool.shrink(min(flags))
        trunk.state.ahead = max(comm.exchange_flags(ahead))     # the views (slots) copy it
    return flags


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
        if all(agree_pool(comm, trunk)):
            serve(comm, trunk)
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
    """A local worker: receive (rank, spec, init_method), say hello, join the group, serve.
    Returns the exit code."""
    _exit_with_parent(parent_pid)
    rank, spec, init_method = conn.recv()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    conn.send(("hello",))
    comm, created = comm_mod.init(rank, spec.tp, spec.device(rank), spec.timeout_s, init_method, START_TIMEOUT_S)
    code = run_worker(comm, spec, created, report=conn.send)
    conn.close()
    return code


def main() -> int:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    return worker_main(Connection(fd), parent_pid)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of torch's threads; everything is already freed
