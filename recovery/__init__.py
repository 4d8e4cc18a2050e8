"""elastic.recovery: replicated in-memory state and the recovery policies (built on elastic.comm).

``ReplicatedStore`` keeps every rank's state in its peers' memory (two-phase
commits, checksums, balanced recovery); ``place_replicas`` / ``plan_transfers``
are its placement and recovery-plan logic. CheckFree reconstruction and the
shrink-or-substitute policy are tracked as their own issues.
"""
from ._placement import Chunk, DataLost, place_replicas, plan_transfers
from ._store import DOMAINS_ENV, ReplicatedStore

__all__ = ["ReplicatedStore", "DataLost", "DOMAINS_ENV", "Chunk", "place_replicas", "plan_transfers"]
