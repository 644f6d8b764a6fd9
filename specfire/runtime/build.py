"""One engine builder for every topology: plain options in, a ready Engine out.

A trunk factory turns the options into a trunk (and the MTP head, by the load-time policy):
`local_trunk` for one device here; a tensor-parallel mesh's is `parallel/build.py mesh_trunk`,
which the caller (api.py) passes in, so the runtime never imports the mesh. The builder then makes
the drafters (drafters/registry.py) and hands everything to the Engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig
from ..model import loader
from ..model.qwen35 import MtpHead
from ..kernels.gdn import fla as gdn_fla
from ..params import SpecPolicy
from ..tokenizer import Tokenizer
from .drafters import DraftSource, MtpDrafter, make_drafters
from ..model.kvpool import KvPool
from .engine import Engine, Shared
from .slots import block_bytes, pool_blocks
from .trunk import LocalTrunk, Trunk


@dataclass(frozen=True)
class EngineOptions:
    """Everything a topology needs to load and run the model (validated by the caller, LLM)."""

    path: str
    cfg: ModelConfig                 # from config.json; the factory follows the checkpoint on tying
    tp: int
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    max_seq_len: int
    spec: SpecPolicy                 # the load-time policy: whether the MTP head is loaded
    mtp_path: str | None = None
    cuda_graphs: bool | None = None  # None = where the attention kernel serves the head size
    ngram: tuple[int, int] = (1, 4)
    progress: bool = False
    draft_vocab: int | None = None   # the MTP drafter scores token ids 0..N-1 only (None: all)
    # the canonical math (layers/__init__.py) on one device, and for the MTP head on a mesh's
    # rank 0: the bits of every tp degree (a mesh's trunk computes them always)
    tp_invariant: bool = False
    max_num_seqs: int = 1            # requests at once (without a KV budget the pool holds this many max_seq)
    kv_cache_memory_bytes: int | None = None    # the KV pool's bytes (None: max_num_seqs sequences)

    @property
    def want_mtp(self) -> str:
        """'never' | 'must' | 'if_present': spec 'off' loads no head, 'mtp' requires one."""
        return {"off": "never", MtpDrafter.name: "must"}.get(self.spec.mode, "if_present")


@dataclass
class BuiltTrunk:
    trunk: Trunk
    mtp_head: MtpHead | None
    topology: str                    # a label for route reasons: "single" | "tp<N>"
    # another trunk over the same weights with its own sequence state (a slot: runtime/slots.py);
    # None where the topology holds one sequence
    fork: Callable[[], Trunk] | None = None


TrunkFactory = Callable[[EngineOptions], BuiltTrunk]


def local_trunk(opts: EngineOptions) -> BuiltTrunk:
    """The trunk on one device."""
    src = loader.open_checkpoint(opts.path)
    cfg = loader.follow_tied(src, opts.cfg)
    model = loader.load_trunk(src, cfg, dtype=opts.dtype, device=opts.device, progress=opts.progress,
                              canonical=opts.tp_invariant)
    head = loader.load_mtp_head(opts.path, src, cfg, opts.dtype, opts.device, opts.want_mtp, opts.mtp_path,
                                canonical=opts.tp_invariant)
    if cfg.n_linear:     # the optional prefill library compiles now, not in the first request (kernels/gdn/fla.py)
        gdn_fla.warm(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim, opts.device)
    trunk = LocalTrunk(model, opts.max_seq_len, opts.kv_dtype, opts.cuda_graphs, opts.draft_vocab,
                       kv_pool(opts, model, head))
    return BuiltTrunk(trunk, head, "single", fork=trunk.view)


def kv_pool(opts: EngineOptions, model, head: MtpHead | None) -> KvPool:
    """The KV pool of the trunk's views: the trunk's attention layers, then the MTP head's (its
    chain writes over the trunk sequence's own blocks), sized by the budget (runtime/slots.py)."""
    heads = model.kv_heads() + (head.kv_heads() if head is not None else [])
    per = block_bytes(heads, model.cfg.head_dim, opts.kv_dtype)
    n = pool_blocks(per, opts.max_seq_len, opts.max_num_seqs, opts.kv_cache_memory_bytes, opts.device)
    return KvPool(heads, model.cfg.head_dim, n, opts.device, opts.kv_dtype)


def build_engine(opts: EngineOptions, tokenizer: Tokenizer | None, eos_ids: set[int],
                 factory: TrunkFactory = local_trunk) -> Engine:
    """The Engine over the trunk `factory` builds, with every drafter the registry makes over it
    (the n-gram drafter always, the MTP drafter when the head was loaded). Its `fork` makes another
    engine over the same weights and `shared` (a slot), where the topology can hold more sequences."""
    built = factory(opts)

    def engine(trunk: Trunk, shared: Shared | None) -> Engine:
        drafters = make_drafters(DraftSource(trunk, built.mtp_head, opts.kv_dtype, opts.ngram))
        return Engine(trunk, tokenizer, eos_ids, drafters, topology=built.topology, shared=shared)

    try:
        first = engine(built.trunk, None)
    except BaseException:
        built.trunk.close()     # a mesh's processes never outlive a failed build
        raise
    fork = built.fork
    if fork is not None:
        first.fork = lambda: engine(fork(), first.shared)
    return first
