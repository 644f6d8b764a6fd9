"""One engine builder for every topology: plain options in, a ready Engine out.

A trunk factory turns the options into a trunk (and the MTP head, by the load-time policy):
`local_trunk` for one device, `parallel.build.mesh_trunk` for a tensor-parallel mesh. The builder
then makes the drafters and hands everything to the Engine, so neither topology builds an engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig, SpecPolicy
from ..errors import SpecfireError
from ..model import loader
from ..model.qwen35 import MtpHead
from ..kernels.gdn import fla as gdn_fla
from ..tokenizer import Tokenizer
from .drafters import Drafter, MtpDrafter, NgramDrafter
from .engine import Engine
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

    @property
    def want_mtp(self) -> str:
        """'never' | 'must' | 'if_present': spec 'off' loads no head, 'mtp' requires one."""
        return {"off": "never", "mtp": "must"}.get(self.spec.mode, "if_present")


@dataclass
class BuiltTrunk:
    trunk: Trunk
    mtp_head: MtpHead | None
    topology: str                    # a label for route reasons: "single" | "tp<N>"


TrunkFactory = Callable[[EngineOptions], BuiltTrunk]


def local_trunk(opts: EngineOptions) -> BuiltTrunk:
    """The trunk on one device."""
    src = loader.open_checkpoint(opts.path)
    cfg = loader.follow_tied(src, opts.cfg)
    model = loader.load_trunk(src, cfg, dtype=opts.dtype, device=opts.device, progress=opts.progress)
    head = loader.load_mtp_head(opts.path, src, cfg, opts.dtype, opts.device, opts.want_mtp, opts.mtp_path)
    if cfg.n_linear:     # the optional prefill library compiles now, not in the first request (kernels/gdn/fla.py)
        gdn_fla.warm(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim, opts.device)
    return BuiltTrunk(LocalTrunk(model, opts.max_seq_len, opts.kv_dtype, opts.cuda_graphs, opts.draft_vocab), head,
                      "single")


def trunk_factory(opts: EngineOptions) -> TrunkFactory:
    """The factory for `opts.tp`."""
    if opts.tp == 1:
        return local_trunk
    try:
        from ..parallel.build import mesh_trunk
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(f"{__package__.rsplit('.', 1)[0]}.parallel"):
            raise
        raise SpecfireError(f"tp={opts.tp} needs the tensor-parallel mesh (specfire.parallel), which this "
                            f"build does not have; use tp=1") from None
    return mesh_trunk


def build_engine(opts: EngineOptions, tokenizer: Tokenizer | None, eos_ids: set[int],
                 factory: TrunkFactory | None = None) -> Engine:
    """The Engine over the trunk `factory` builds (by default the one for `opts.tp`), with the
    n-gram drafter and, when the head was loaded, the MTP drafter."""
    built = (factory or trunk_factory(opts))(opts)
    try:
        drafters: dict[str, Drafter] = {"ngram": NgramDrafter(*opts.ngram)}
        if built.mtp_head is not None:
            drafters["mtp"] = MtpDrafter(built.mtp_head, built.trunk, opts.kv_dtype)
        return Engine(built.trunk, tokenizer, eos_ids, drafters, topology=built.topology)
    except BaseException:
        built.trunk.close()     # a mesh's processes never outlive a failed build
        raise
