"""elastic.recovery: replicated in-memory state and the recovery policies (built on elastic.comm).

``ReplicatedStore`` keeps every rank's state in its peers' memory (two-phase
commits, checksums, balanced recovery), ``ParityStore`` the same by XOR or
Reed-Solomon parity over groups of peers (``Redundancy`` says which); ``share`` copies what every rank holds
alike (which the store need not replicate) to a replacement, from the
survivors; ``place_replicas`` / ``plan_transfers`` are its placement and
recovery-plan logic; ``Policy`` decides, at each rebuild,
between a spare, a spawned process and shrinking; ``plan_stage_recovery`` /
``checkfree_average`` bring a lost pipeline stage back from a replica or, with
none, from its neighbours (CheckFree / CheckFree+); ``plan_mesh_recovery`` does
it for a data x pipeline mesh, a live data-parallel twin first.

The store (which needs MPI) loads on first use.
"""
from typing import TYPE_CHECKING

from elastic.comm.runtime import lazy_exports

from ._errors import CommitRejected, NothingCommitted
from ._checkfree import (LR_BOOST, MeshRecovery, Method, StageRecovery, checkfree_average, plan_mesh_recovery,
                         plan_stage_recovery, replica_holders, whole_replicas)
from ._parity import Redundancy
from ._placement import Chunk, DataLost, place_replicas, plan_transfers
from ._policy import Policy

if TYPE_CHECKING:
    from ._share import share, share_within
    from ._fetch import Adopt
    from ._store import ReplicatedStore
    from ._paritystore import ParityStore
    from ._sums import checksum

__getattr__, __dir__ = lazy_exports(globals(), {
    "ReplicatedStore": "._store", "ParityStore": "._paritystore", "checksum": "._sums", "Adopt": "._fetch",
    "share": "._share", "share_within": "._share",
})

__all__ = ["ReplicatedStore", "ParityStore", "Redundancy", "DataLost", "CommitRejected", "NothingCommitted", "Chunk",
           "place_replicas", "plan_transfers", "Policy", "checksum", "StageRecovery", "plan_stage_recovery",
           "MeshRecovery", "plan_mesh_recovery", "whole_replicas", "checkfree_average",
           "replica_holders", "LR_BOOST", "Adopt", "share", "share_within", "Method"]
