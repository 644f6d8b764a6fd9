"""The tensor-parallel mesh. One job per module:

shard.py      how weights and state split over ranks       model.py   a rank's sharded trunk
comm.py       every collective                            launch.py  starting ranks (local or torchrun)
control.py    rank 0 calls a Trunk method on every rank   worker.py  a rank's life: load, serve, free
lifecycle.py  faults and teardown                         trunk.py   MeshTrunk, the Trunk on rank 0
build.py      the trunk factory that runtime/build.py calls for tp > 1
symm.py       collectives inside CUDA graphs (symmetric memory; gloo on the CPU)
probe.py      timing probes: a rows graph replayed alone, kernel time by family (bench/tp.py)
draft.py      the greedy MTP draft's picks sharded by vocabulary (every rank scores its lm_head rows)
"""
from .shard import ShardPlan, check_degree, valid_tp_degrees

__all__ = ["ShardPlan", "check_degree", "valid_tp_degrees"]
