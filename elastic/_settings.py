"""The training layer's settings: one row each (``elastic.comm``'s ``Setting``), its own table.

What a roll-back, a straggler and the progress line act on belongs here, not in comm's
``Config``: the launcher makes its options and the processes' variables from these rows
(``ROWS``), and a rank reads them from its job's environment (``Training.of(world)``), where the
launcher put them (a spawned replacement gets its parents').
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from elastic.comm import ConfigError, Group
from elastic.comm.runtime import Setting, check, fields_match, read, write
from elastic.recovery import Redundancy


class OnNonFinite(enum.Enum):
    """What a NaN or an Inf at a recovery point does (the version is never made current)."""

    ROLLBACK = "rollback"  # every rank back to the last good version, then the step again
    SKIP = "skip"          # the same, and the offending step is dropped
    STOP = "stop"          # an agreed error

    @classmethod
    def of(cls, value: OnNonFinite | str, where: str = "on_nonfinite") -> OnNonFinite:
        """``value`` as a member, or a ``ConfigError`` naming ``where`` and what to give."""
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ConfigError(f"{where}={value!r}: give one of {', '.join(m.value for m in cls)}") from None


@dataclasses.dataclass(frozen=True)
class Training:
    """The training layer's settings (``ROWS`` names each one's variable, check and option).

    Args:
        max_failures: failures (or roll-backs) in a row without a successful commit before the job stops.
        progress_every / progress_seconds: a progress line on rank 0 every that many steps
            and/or seconds (0: not by that measure).
        on_nonfinite: a NaN or Inf in the loss, the gradients' norm or the committed values at a
            recovery point (``OnNonFinite``).
        straggler_factor: a rank whose own work per step is this many times the median's ...
        straggler_steps: ... for this many steps in a row is evicted like a failed rank (0: off).
        keep_versions: committed versions a ``State`` keeps, the current one included: a step not
            finite again after its roll-back goes back one more (``ReplicatedStore.fall_back``).
        twin_check_every: steps between the twins' comparison of their shards (``State(twins=...)``,
            ``_gate.TwinCheck``; 0: off).
        gate_every: with ``per_step=True``, the integrity gate runs at the step point of every that
            many steps (``commit()`` runs it always; 0: at ``commit()`` only).
        redundancy: how a ``State`` keeps its rank-unique values recoverable (``Redundancy``:
            ``copies:R``, ``xor:K``, ``rs:K+M``); None: its ``replication`` argument's copies.
    """

    max_failures: int = 3
    progress_every: int = 10
    progress_seconds: float = 0.0
    on_nonfinite: OnNonFinite = OnNonFinite.ROLLBACK
    straggler_factor: float = 0.0
    straggler_steps: int = 5
    keep_versions: int = 1
    twin_check_every: int = 100
    gate_every: int = 100
    redundancy: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_nonfinite", OnNonFinite.of(self.on_nonfinite))
        check(ROWS, self)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Training:
        """The settings ``environ`` gives, then ``overrides`` (None values ignored)."""
        return cls(**read(ROWS, environ, overrides))

    @classmethod
    def of(cls, world: Group) -> Training:
        """This rank's settings: its job's environment (local)."""
        return cls.from_env(world.job.environ)

    def to_env(self) -> dict[str, str]:
        return write(ROWS, self)


ROWS = (
    Setting("max_failures", "ELASTIC_MAX_FAILURES", int, "takes integers >= 0", lambda v: v >= 0),
    Setting("progress_every", "ELASTIC_PROGRESS_EVERY", int, "takes steps >= 0 (0: not by steps)", lambda v: v >= 0),
    Setting("progress_seconds", "ELASTIC_PROGRESS_SECONDS", float, "takes seconds >= 0 (0: not by time)",
            lambda v: v >= 0),
    Setting("on_nonfinite", "ELASTIC_ON_NONFINITE", lambda t: OnNonFinite(t.strip().lower()),
            f"give one of {', '.join(m.value for m in OnNonFinite)}", option="--on-nonfinite",
            help="a NaN / Inf at a commit: roll back and run the step again, roll back and drop the step, or stop",
            choices=tuple(m.value for m in OnNonFinite)),
    Setting("straggler_factor", "ELASTIC_STRAGGLER_FACTOR", float, "takes a factor > 1, or 0 for off",
            lambda v: v == 0 or v > 1),
    Setting("straggler_steps", "ELASTIC_STRAGGLER_STEPS", int, "takes steps >= 1", lambda v: v >= 1),
    Setting("keep_versions", "ELASTIC_KEEP_VERSIONS", int, "takes versions >= 1 (the current one counts)",
            lambda v: v >= 1, "--keep-versions", "committed versions each State keeps: a step not finite again "
            "after its roll-back goes back one more, K - 1 at most; each costs one version's memory"),
    Setting("twin_check_every", "ELASTIC_TWIN_CHECK_EVERY", int, "takes steps >= 0 (0: off)", lambda v: v >= 0,
            "--twin-check-every", "steps between the twins' comparison of the shards they hold alike "
            "(State(twins=...)): a twin that differs from its shard's majority is replaced, two that differ stop "
            "the job; XXH3 over the shard, ~0.2 s per GB; 0: off"),
    Setting("gate_every", "ELASTIC_GATE_EVERY", int, "takes steps >= 0 (0: at commit() only)", lambda v: v >= 0,
            "--gate-every", "with State(per_step=True): steps between the integrity gate's checks at the step point "
            "(a NaN / Inf stops the job, a rank whose shared values differ from the majority's is replaced); "
            "XXH3 over the shared values, 1/size of them scanned per rank (bench_gate.py); 0: at commit() only"),
    Setting("redundancy", "ELASTIC_REDUNDANCY", lambda t: str(Redundancy.parse(t)) if t.strip() else None,
            "takes copies:R, xor:K or rs:K+M", lambda v: v is None or bool(Redundancy.parse(v)), "--redundancy",
            "how each State keeps its rank-unique values (its shards, RNG states) recoverable: copies:R (R whole "
            "copies, on R - 1 peers), xor:K (parity over groups of K ranks, 1/(K-1) of the memory, one loss per "
            "group) or rs:K+M (Reed-Solomon, M losses per group); default: State's replication= (2 copies)"),
)
fields_match(ROWS, Training)
FIELDS = frozenset(row.name for row in ROWS)
