"""The tensor-parallel mesh: process group, rank-0 driver, worker loop, collectives."""
from .shard import ShardPlan, check_degree, valid_tp_degrees


def build_mesh_engine(llm, want_mtp: str, mtp_path: str | None = None):
    """The Engine of a tp > 1 LLM; see mesh.build_mesh_engine."""
    from .mesh import build_mesh_engine as build

    return build(llm, want_mtp=want_mtp, mtp_path=mtp_path)


__all__ = ["ShardPlan", "build_mesh_engine", "check_degree", "valid_tp_degrees"]
