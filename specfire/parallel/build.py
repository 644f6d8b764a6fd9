"""The mesh's trunk factory for `runtime/build.py`: start (or join) the ranks and return rank 0's
MeshTrunk with the MTP head, and its `view` as the fork that makes another slot.

The degree is checked and the MTP head loaded (rank 0 only, by the load-time policy) before any
process starts, so a refused degree or a missing head never leaves processes behind.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import weakref

import torch

from ..errors import CheckpointError, MeshError, SpecfireError
from ..model import loader
from ..runtime.build import BuiltTrunk, EngineOptions
from ..runtime.drafters.mtp import AHEAD
from . import comm as comm_mod
from .launch import (START_TIMEOUT_S, LocalWorker, MeshSpec, kill_workers, mesh_timeout, placement,
                     start_local_workers, worker_errors)
from .lifecycle import Mesh
from .shard import check_degree, quant_problem, valid_tp_degrees
from .trunk import MeshTrunk
from .worker import agree_pool, load_shard, run_worker

log = logging.getLogger("specfire")

_open_meshes: "weakref.WeakSet[MeshTrunk]" = weakref.WeakSet()


def _drafter_vocab(src: loader.TensorSource, cfg, head, dtype: torch.dtype,
                   device: torch.device, graphs: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the MTP drafter's embedding and lm_head calls run. On the CPU a whole copy on rank 0
    (a gloo round trip costs milliseconds, the whole lm_head a tenth of one: docs/PERFORMANCE.md);
    on the GPU, where the trunk replays CUDA graphs, a whole copy too, so the draft chain is one
    graph on rank 0; an eager GPU mesh goes through the mesh (each rank reads 1/tp of the largest
    matrix, for one small collective, and rank 0 holds no extra copy). None without an MTP head."""
    if head is None or (device.type != "cpu" and not graphs):
        return None
    emb = loader.aligned(src.get("embed_tokens.weight").to(device=device, dtype=dtype))
    lm = emb if cfg.tie_word_embeddings else loader.aligned(src.get("lm_head.weight").to(device=device, dtype=dtype))
    return emb, lm


def mesh_trunk(opts: EngineOptions) -> BuiltTrunk:
    """Rank 0's trunk over `opts.tp` ranks. On a torchrun rank other than 0 this serves rank 0
    until it closes, then exits the process."""
    tp = opts.tp
    check_degree(opts.cfg, tp)
    if any(not m.closed for m in _open_meshes):
        raise SpecfireError("a tensor-parallel LLM is already open in this process; close it first")
    timeout_s = mesh_timeout()
    src = loader.open_checkpoint(opts.path)
    why = quant_problem(opts.cfg, tp, src)   # 4-bit: column shards must fall on quantization groups
    if why is not None:
        ok = [d for d in valid_tp_degrees(opts.cfg) if quant_problem(opts.cfg, d, src) is None]
        raise CheckpointError(f"{opts.path}: {why}; tp degrees this 4-bit checkpoint allows: {', '.join(map(str, ok))}")
    cfg = loader.follow_tied(src, opts.cfg)
    place = placement(tp)
    dev = opts.device
    base = (dev.index or 0) - (place.local_rank if place.joined else 0) if dev.type == "cuda" else 0
    threads = None if place.joined or dev.type != "cpu" else max(1, (os.cpu_count() or 1) // tp)
    spec = MeshSpec(path=opts.path, cfg=cfg, tp=tp, dtype=opts.dtype, device_type=dev.type,
                    device_base=max(0, base), max_seq=opts.max_seq_len, kv_dtype=opts.kv_dtype,
                    timeout_s=timeout_s, threads=threads, cuda_graphs=opts.cuda_graphs, draft_vocab=opts.draft_vocab,
                    max_num_seqs=opts.max_num_seqs, kv_budget=opts.kv_cache_memory_bytes)
    my_device = spec.device(place.local_rank)
    if place.joined and place.rank != 0:
        comm, created = comm_mod.init(place.rank, tp, my_device, timeout_s, None, START_TIMEOUT_S)
        sys.exit(run_worker(comm, spec, created))

    head = loader.load_mtp_head(opts.path, src, cfg, opts.dtype, my_device, opts.want_mtp, opts.mtp_path,
                                canonical=opts.tp_invariant)
    store = None
    workers: list[LocalWorker] = []
    if not place.joined:
        fd, store = tempfile.mkstemp(prefix="specfire-mesh-")
        os.close(fd)
        os.unlink(store)
        workers = start_local_workers(spec, store)
    try:
        comm, created = comm_mod.init(0, tp, my_device, timeout_s, None if place.joined else "file://" + store,
                                      START_TIMEOUT_S)
    except Exception as e:
        kill_workers(workers)
        raise MeshError(f"the tensor-parallel mesh could not form: {str(e).splitlines()[0] if str(e) else e!r}") from None
    threads_before = None
    if threads is not None:
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
    mesh = Mesh(comm, created, workers, store, threads_before, timeout_s)
    trunk, err = None, None
    try:
        trunk = load_shard(spec, comm, head.kv_heads() if head is not None else [])
    except Exception as e:
        err = e
    try:
        flags = agree_pool(comm, trunk, AHEAD if head is not None else 0)
    except Exception as e:
        raise mesh.fail(e) from None
    if not all(flags):
        worker_errs = worker_errors(workers)
        mesh.teardown(graceful=False)
        if err is not None:
            raise err
        bad = [r for r, f in enumerate(flags) if not f]
        name, msg = worker_errs[0] if worker_errs else ("", f"rank {bad[0]} failed to load its shard (see its log)")
        raise (CheckpointError if name in ("CheckpointError", "ConfigError") else MeshError)(msg)
    mt = MeshTrunk(mesh, trunk, tp, opts.dtype,
                   _drafter_vocab(src, cfg, head, opts.dtype, my_device, trunk.graphs_enabled), opts.draft_vocab)
    _open_meshes.add(mt)
    log.info("tensor-parallel mesh of %d ranks ready (%s)", tp, "joined" if place.joined else "local workers")
    return BuiltTrunk(mt, head, topology=f"tp{tp}", fork=mt.view)
