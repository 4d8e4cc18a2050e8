"""Names a package exports without importing their modules until first use.

``from mpi4py import MPI`` initializes MPI, so a package that imported its MPI
modules eagerly would start MPI in every process that merely reads a run's
events: the launcher, the report, the sentinel. Packages list such names here.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(namespace: dict[str, Any], where: dict[str, str]) -> tuple[Callable[[str], Any],
                                                                          Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package whose globals are ``namespace``.

    ``where`` maps each lazy name to the module (relative to the package) that defines it.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__


def keep_mpi_uninitialized() -> None:
    """For tools (the launcher, the report): a later ``from mpi4py import MPI`` in this process must
    not start MPI (a singleton MPI_Init can start a PMIx server or reach for a batch system).

    Left alone in a process an MPI launcher started (an MPI rank, a pytest-mpi run): there the
    program means to use MPI, and ``elastic.init()`` initializes it if it was not.
    """
    import os
    import sys

    if "mpi4py.MPI" not in sys.modules and not any(k in os.environ for k in ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE")):
        import mpi4py
        mpi4py.rc.initialize = False
