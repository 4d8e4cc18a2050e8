"""The state layer's errors, by what the caller does next (kinds of ``ConfigError``: the program is wrong).

``DataLost`` (every copy of some state died) is the placement's, in ``_placement``.
"""
from __future__ import annotations

from elastic.comm import ConfigError


class CommitRejected(ConfigError):
    """A commit refused on every rank alike (a shared value differs, a value cannot be stored, the
    versions differ): nothing was replaced, the last version is still current; fix the values and
    commit again."""


class NothingCommitted(ConfigError):
    """A restore before any commit: there is no version to go back to; commit first."""
