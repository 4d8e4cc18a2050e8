"""elastic.recovery: replicated in-memory state and the recovery policies (built on elastic.comm).

So far: replica placement over failure domains and the balanced recovery plan
(pure functions). The store that moves the bytes, CheckFree reconstruction and
the shrink-or-substitute policy are tracked as their own issues.
"""
from ._placement import Chunk, DataLost, place_replicas, plan_transfers

__all__ = ["Chunk", "DataLost", "place_replicas", "plan_transfers"]
