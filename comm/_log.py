"""The project's loggers: ``elastic`` and below (``elastic.comm``, ``elastic.events``, ...).

A program that configured logging itself (a handler on the root logger) gets
the records there. Otherwise the first ``init()`` gives ``elastic`` two
handlers of its own: the message alone, INFO and below on stdout (the progress
lines), WARNING and above on stderr.
"""
from __future__ import annotations

import logging
import sys


def setup(level: str) -> None:
    """Set the ``elastic`` loggers' level, and their handlers unless the program has its own (local)."""
    top = logging.getLogger("elastic")
    top.setLevel(level)
    if top.handlers or logging.getLogger().handlers:
        return
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(logging.Formatter("%(message)s"))
        top.addHandler(handler)
    top.propagate = False
