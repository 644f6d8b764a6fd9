"""Launch settings of the 4-bit GEMV (gemv.py), a function of the weight's shape (N, K, G) only,
never of M, so every row count runs the same arithmetic."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .._triton import triton


@dataclass(frozen=True)
class Q4Config:
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 2
    num_stages: int = 4
    wa: bool = False      # codes as the MMA's A operand (y^T = W x^T): fewer register moves in the sm_90 loop
    rows: int = 16        # row tile: 8 halves the MMAs, x fragments and epilogue FMAs per code word (M > 8: 2 tiles)
    zc: int = 0           # > 0: zero-point term after the loop, zc groups at a time, sum(x) made there (no launch first)
    rows_hi: int = 0      # > rows: calls of more than `rows` rows run tiles of rows_hi rows (M = 9..16: one 16-row
                          # tile reads the codes once, where two 8-row tiles read them twice); 0: tiles of `rows`

    def __post_init__(self):
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        if not pow2(self.rows) or self.rows < 8:
            raise ValueError(f"Q4Config.rows must be a power of two >= 8, got {self.rows}")
        if self.rows_hi and (not pow2(self.rows_hi) or self.rows_hi <= self.rows):
            raise ValueError(f"Q4Config.rows_hi must be 0 or a power of two above rows={self.rows}, got {self.rows_hi}")
        if self.zc and not pow2(self.zc):
            raise ValueError(f"Q4Config.zc must be 0 or a power of two, got {self.zc}")


# (N, K) at group 128 -> launch settings measured on the H200, codes in 64-row tiles: the launch
# shapes of a 27B step (grouped projections launch with their concatenated N) and the MTP fc won
# a sweep of least t(M=1) + t(M=4), every candidate bitwise row-invariant.
_MEASURED = {
    # single weights (a group one launch cannot hold)
    (17408, 5120): Q4Config(128, split_k=3, num_warps=2, num_stages=3, wa=True, rows=8),   # MLP gate, up
    (12288, 5120): Q4Config(64, split_k=4, num_warps=2, num_stages=3, wa=True, rows=8),    # attention q + gate
    (10240, 5120): Q4Config(64, split_k=4, num_warps=2, num_stages=3, wa=True, rows=8),    # GDN qkv
    (6144, 5120): Q4Config(64, split_k=8, num_warps=2, num_stages=3, wa=True, rows=8),     # GDN z
    (1024, 5120): Q4Config(32, split_k=18, num_warps=1, num_stages=4, wa=True, rows=8),    # attention k, v
    # launch shapes of a 27B step and the MTP fc
    (5120, 17408): Q4Config(64, split_k=13, num_warps=2, num_stages=3, wa=True, rows=8, rows_hi=16),   # MLP down
    (5120, 6144): Q4Config(64, split_k=10, num_warps=2, num_stages=3, wa=True, rows=8, rows_hi=16),    # attn o, GDN out
    (248320, 5120): Q4Config(32, split_k=1, num_warps=1, num_stages=4, wa=True, rows=8, rows_hi=16),  # lm_head
    (34816, 5120): Q4Config(64, split_k=3, num_warps=2, num_stages=3, wa=True, rows=8, rows_hi=16),   # gate + up
    (16384, 5120): Q4Config(64, split_k=3, num_warps=2, num_stages=3, wa=True, rows=8, rows_hi=16),   # GDN qkv + z
    (14336, 5120): Q4Config(128, split_k=7, num_warps=2, num_stages=3, wa=True, rows=8, rows_hi=16),  # attn q+g, k, v
    (5120, 10240): Q4Config(64, split_k=9, num_warps=2, num_stages=3, wa=True, rows=8, rows_hi=16),   # MTP fc
}


# (N, K, M) -> (block_n, num_warps, num_stages) for an M-row launch of a shape whose settings are
# q4_config's: only these fields move (the same MMA chain and split-K sums per element, so the
# bits of q4_config's launch); the draft chain's lm_head over a 32k draft vocabulary.
M_TILES: dict[tuple[int, int, int], tuple[int, int, int]] = {(32768, 5120, 1): (32, 1, 3)}


def launch_config(cfg: Q4Config, n: int, k: int, group: int, m: int) -> Q4Config:
    """cfg for an M-row launch of a weight (or group) of N x K: M_TILES' tile for (N, K, M) when cfg
    is that shape's q4_config, else cfg itself."""
    t = M_TILES.get((n, k, m))
    if t is None or cfg != q4_config(n, k, group):
        return cfg
    return dataclasses.replace(cfg, block_n=t[0], num_warps=t[1], num_stages=t[2])


def q4_config(n: int, k: int, group: int) -> Q4Config:
    """Launch configuration from the weight's shape only (never from M): the measured one for the
    27B shapes, else what won most of them, 64 columns on two warps, 3 stages, codes as the A
    operand, 8-row tiles, with the split-K that fills an H200 at once (about 6 CTAs per SM)."""
    if group == 128 and (n, k) in _MEASURED:
        return _MEASURED[(n, k)]
    return Q4Config(64, split_k=max(1, min(k // group, 792 // triton.cdiv(n, 64))), num_stages=3, wa=True, rows=8)


def group_config(whole_ns: list[int], k: int, group: int) -> Q4Config:
    """Settings of weights of one input launched together: those of their concatenation (the sum
    of the whole matrices' N, measured for the 27B groups). A function of the whole shapes only,
    so a tensor-parallel shard group computes every element as the whole group does."""
    return q4_config(sum(whole_ns), k, group)
