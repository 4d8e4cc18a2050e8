"""Settings declared once: a row per setting, from which a settings record is read, checked and sent on.

A row names the setting (a field of its record), its ``ELASTIC_*`` variable, how the variable's
text is read, what a valid value is and what to give instead, and the launcher's option for it.
``read`` builds a record's values from an environment, ``check`` refuses a wrong one naming the
variable, ``write`` gives the variables back (what the launcher hands every process). comm's
``Config`` and the training layer's settings are two tables of rows; nothing else reads an
``ELASTIC_*`` variable of theirs. Imports no MPI.
"""
from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Callable, Mapping, Sequence

from ._errors import ConfigError


def _always(value: Any) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of a record (its default is the record's field default)."""

    name: str                                     # the record's field
    env: str                                      # the ELASTIC_* variable that carries it
    parse: Callable[[str], Any]                   # the variable's text -> the value
    what: str                                     # what to give, when a value is refused
    valid: Callable[[Any], bool] = _always        # a value the record takes
    option: str | None = None                     # the launcher's option (None: only the variable)
    help: str = ""                                # the option's help; the default is added to it
    choices: tuple[str, ...] | None = None        # the option's choices, where a list says it best


def text(value: Any) -> str:
    """A value as its variable carries it (``read`` gives it back)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json.dumps(dataclasses.asdict(value))
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple) and value and hasattr(value[0], "to_dict"):
        return json.dumps([v.to_dict() for v in value])
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, enum.Enum):
        return str(value.value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def read(rows: Sequence[Setting], environ: Mapping[str, str], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The values ``environ`` sets, then ``overrides`` (None values ignored); a variable that cannot
    be read is refused naming it and what to give."""
    values: dict[str, Any] = {}
    for row in rows:
        raw = environ.get(row.env)
        if raw is None:
            continue
        try:
            values[row.name] = row.parse(raw)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{row.env}={raw!r} ({row.name}): {row.what}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


def check(rows: Sequence[Setting], record: Any) -> None:
    """Refuse the first field of ``record`` its row does not take, naming the variable."""
    for row in rows:
        value = getattr(record, row.name)
        if not row.valid(value):
            raise ConfigError(f"{row.env}={text(value)!r} ({row.name}): {row.what}")


def write(rows: Sequence[Setting], record: Any) -> dict[str, str]:
    """Every variable, so that ``read`` gives ``record`` back whatever else is set."""
    return {row.env: "" if getattr(record, row.name) is None else text(getattr(record, row.name)) for row in rows}


def fields_match(rows: Sequence[Setting], record_type: type) -> None:
    """A record's fields and its rows are the same names, each once (checked where the table is made)."""
    names = [row.name for row in rows]
    fields = [f.name for f in dataclasses.fields(record_type)]
    if sorted(names) != sorted(fields) or len(set(names)) != len(names):
        raise AssertionError(f"{record_type.__name__}: rows {sorted(names)} and fields {sorted(fields)} differ")
