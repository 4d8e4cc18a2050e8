"""The names of the settings the launcher hands to every process, and their allowed values.

Kept apart from the MPI modules so that the launcher, the policy and the
sentinel can read them without starting MPI.
"""
from __future__ import annotations

SPARES_ENV = "ELASTIC_SPARES"
REBUILD_ENV = "ELASTIC_REBUILD"
MIN_SIZE_ENV = "ELASTIC_MIN_SIZE"
MODES = ("spare", "spawn", "shrink")
