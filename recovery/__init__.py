"""elastic.recovery: replicated in-memory state and the recovery policies (built on elastic.comm).

Not yet implemented: the ReStore-style store, CheckFree reconstruction and the
shrink-or-substitute policy are tracked as their own issues.
"""

__all__: list[str] = []
