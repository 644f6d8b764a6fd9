"""How a Qwen3.5 trunk is split over `tp` ranks, and the fetch hook that reads one rank's slices.

Split (the usual Megatron-style plan for this architecture): attention by query head (q_proj keeps its
per-head interleaved gate), KV heads split when tp divides them and replicated when tp is a
multiple of them; Gated DeltaNet q/k/v/z/a/b, conv channels, A_log and dt_bias by head, segment by
segment; MLP gate/up by output row, down by input column; embedding and lm_head by vocabulary row,
the vocabulary padded up to a multiple of tp. Norms are replicated. Each rank reads only its own
bytes from the memory-mapped checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..model.loader import TensorSource
from ..kernels.splitk import degree_problem as split_problem

MAX_DEGREE = 64


def degree_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why `tp` cannot split this model (naming the head count), or None when it can."""
    for name, n in (("num_attention_heads", cfg.num_attention_heads),
                    ("linear_num_key_heads", cfg.linear_num_key_heads),
                    ("linear_num_value_heads", cfg.linear_num_value_heads)):
        if n % tp:
            return f"tp={tp} does not divide {name}={n}"
    nkv = cfg.num_key_value_heads
    if nkv % tp and tp % nkv:
        return f"tp={tp} neither divides nor is a multiple of num_key_value_heads={nkv}"
    return split_problem(tp)


def valid_tp_degrees(cfg: ModelConfig, upto: int = MAX_DEGREE) -> list[int]:
    return [d for d in range(1, upto + 1) if degree_problem(cfg, d) is None]


def check_degree(cfg: ModelConfig, tp: int) -> None:
    """Refuse a degree that does not split every head count, before any process starts."""
    why = degree_problem(cfg, tp)
    if why is not None:
        raise ValueError(f"{why}; valid tp degrees for this model: "
                         f"{', '.join(map(str, valid_tp_degrees(cfg)))}")


@dataclass(frozen=True)
class ShardPlan:
    """The slice of every weight and state that rank `rank` of `tp` holds."""

    cfg: ModelConfig
    tp: int
    rank: int

    def __post_init__(self) -> None:
        check_degree(self.cfg, self.tp)
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is outside 0..{self.tp - 1}")

    # ---- attention -----------------------------------------------------------------------------
    @property
    def n_heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp

    @property
    def n_kv(self) -> int:
        nkv = self.cfg.num_key_value_heads
        return nkv // self.tp if self.tp <= nkv else 1

    @property
    def kv0(self) -> int:
        """First KV head of this rank; with replication, the one its query heads read."""
        rep = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        return (self.rank * self.n_heads) // rep

    # ---- Gated DeltaNet ------------------------------------------------------------------------
    @property
    def n_k_heads(self) -> int:
        return self.cfg.linear_num_key_heads // self.tp

    @property
    def n_v_heads(self) -> int:
        return self.cfg.linear_num_value_heads // self.tp

    @property
    def conv_dim(self) -> int:
        c = self.cfg
        return 2 * self.n_k_heads * c.linear_key_head_dim + self.n_v_heads * c.linear_value_head_dim

    # ---- MLP (any size: ranks may differ by one row) -------------------------------------------
    @property
    def inter(self) -> tuple[int, int]:
        i = self.cfg.intermediate_size
        return i * self.rank // self.tp, i * (self.rank + 1) // self.tp

    # ---- vocabulary ----------------------------------------------------------------------------
    @property
    def vocab_shard(self) -> int:
        return -(-self.cfg.vocab_size // self.tp)

    @property
    def vocab(self) -> tuple[int, int]:
        """Real rows [v0, v1) of this rank; rows past v1 up to vocab_shard are zero padding."""
        v0 = self.rank * self.vocab_shard
        return min(v0, self.cfg.vocab_size), min(v0 + self.vocab_shard, self.cfg.vocab_size)

    # ---- reading -------------------------------------------------------------------------------
    def slices(self, name: str) -> list[tuple[slice, ...]] | None:
        """The pieces of tensor `name` this rank holds (concatenated along dim 0 or 1), None = all."""
        c, r = self.cfg, self.rank

        def rows(a: int, n: int) -> tuple[slice, ...]:
            return (slice(a, a + n),)

        def cols(a: int, n: int) -> tuple[slice, ...]:
            return (slice(None), slice(a, a + n))

        d = c.head_dim
        leaf = name.rsplit(".", 2)
        tail = ".".join(leaf[-2:])
        if name in ("embed_tokens.weight", "lm_head.weight"):
            v0, v1 = self.vocab
            return [rows(v0, v1 - v0)]
        if ".self_attn." in name:
            if tail == "q_proj.weight":                      # [Hq * 2D, H], per head [q | gate]
                return [rows(r * self.n_heads * 2 * d, self.n_heads * 2 * d)]
            if tail in ("k_proj.weight", "v_proj.weight"):
                return [rows(self.kv0 * d, self.n_kv * d)]
            if tail == "o_proj.weight":
                return [cols(r * self.n_heads * d, self.n_heads * d)]
            return None                                      # q_norm, k_norm
        if ".linear_attn." in name:
            kd, vd = self.n_k_heads * c.linear_key_head_dim, self.n_v_heads * c.linear_value_head_dim
            kd_all = c.linear_key_dim
            if tail in ("in_proj_qkv.weight", "conv1d.weight"):   # segments [q | k | v] along dim 0
                return [rows(r * kd, kd), rows(kd_all + r * kd, kd), rows(2 * kd_all + r * vd, vd)]
            if tail == "in_proj_z.weight":
                return [rows(r * vd, vd)]
            if tail in ("in_proj_a.weight", "in_proj_b.weight") or name.endswith((".A_log", ".dt_bias")):
                return [rows(r * self.n_v_heads, self.n_v_heads)]
            if tail == "out_proj.weight":
                return [cols(r * vd, vd)]
            return None                                      # norm
        if ".mlp." in name:
            i0, i1 = self.inter
            if tail in ("gate_proj.weight", "up_proj.weight"):
                return [rows(i0, i1 - i0)]
            if tail == "down_proj.weight":
                return [cols(i0, i1 - i0)]
        return None

    def fetch(self, src: TensorSource, name: str, param: torch.nn.Parameter):
        """loader.load_module hook: read only this rank's slices (zero-padded vocabulary rows). A
        4-bit weight comes back as a QuantWeight of this rank's rows or (group-aligned) columns."""
        pieces = self.slices(name)
        if pieces is None:
            return src.get(name)
        dim = 1 if len(pieces[0]) == 2 and pieces[0][0] == slice(None) else 0
        parts = [src.get(name, index=p) for p in pieces]
        pad = self.vocab_shard - parts[0].shape[0] if name in ("embed_tokens.weight", "lm_head.weight") else 0
        if not isinstance(parts[0], torch.Tensor):
            return quant_rows(parts, pad)
        t = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
        if pad > 0:
            t = torch.cat([t, torch.zeros(pad, *t.shape[1:], dtype=t.dtype)])
        return t

    def quant_problem(self, src: TensorSource) -> str | None:
        """Why this rank's shard of a 4-bit checkpoint cannot be read (a column shard off the
        quantization groups), or None. Checked for every rank before any process starts."""
        for name in src.names():
            if not src.is_quantized(name):     # the MTP head's layer is split as a trunk layer is
                continue
            for p in self.slices(name) or []:
                if len(p) == 2 and p[0] == slice(None):
                    k = src.shape(name)[1]
                    g = src.quant_group(name)
                    if p[1].start % g or p[1].stop % g:
                        return (f"tp={self.tp} splits the {k} input columns of 4-bit '{name}' at "
                                f"{p[1].start}..{p[1].stop}, not on its {g}-column quantization groups")
        return None


def quant_problem(cfg: ModelConfig, tp: int, src: TensorSource) -> str | None:
    """The first rank whose 4-bit column shards miss the quantization groups, or None."""
    for r in range(tp):
        why = ShardPlan(cfg, tp, r).quant_problem(src)
        if why is not None:
            return why
    return None


def quant_rows(parts: list, pad: int):
    """Output-row pieces of a 4-bit weight as one QuantWeight, plus `pad` zero rows (a zero code,
    scale and zero dequantise to 0). Column pieces are never concatenated (one piece per rank)."""
    from ..kernels.q4 import QuantWeight

    if len(parts) == 1 and pad <= 0:
        return parts[0]
    q = torch.cat([p.qweight for p in parts])
    s = torch.cat([p.scales_t for p in parts], dim=1)
    z = torch.cat([p.zeros_t for p in parts], dim=1)
    if pad > 0:
        q = torch.cat([q, torch.zeros(pad, q.shape[1], dtype=q.dtype)])
        s = torch.cat([s, torch.zeros(s.shape[0], pad, dtype=s.dtype)], dim=1)
        z = torch.cat([z, torch.zeros(z.shape[0], pad, dtype=z.dtype)], dim=1)
    return QuantWeight(q, s, z, parts[0].hadamard, parts[0].dtype)
