"""What the layers above use of comm's runtime beside the ``Group``: for the launcher, tools and
tests of this project, not for training programs (those see ``elastic`` and ``elastic.comm``).

One public door instead of reaching into comm's private modules: the relaunch
record the launcher hands every process, the membership table's spare marker,
the rebuild modes, the sentinel's bound for a stopped sentinel and its wait for the warm process, how a tool
keeps MPI uninitialized, how a package loads its names on first use, how to
tell an agreed error (raised alike on every rank) from a local one, a
``Group``'s first survivor (for anything that implements the contract), and the
settings table's rows (``Setting``: the training layer declares its own), with
comm's (``CONFIG_ROWS``) for the launcher's options, and the rebuild's fill rule
(``fill``, ``asked``, ``would_fill``: a simulated job follows the real one's). Importing it starts no MPI.
"""
from ._config import MODES, Relaunch
from ._config import ROWS as CONFIG_ROWS
from ._errors import is_agreed
from ._group import first_survivor
from ._lazy import keep_mpi_uninitialized, lazy_exports
from ._policy import asked, fill, would_fill
from ._ranks import SPARE
from ._table import Setting, check, fields_match, read, text, write
from ._warm import ANSWER_SECONDS as WARM_ANSWER_SECONDS
from ._warm import serving_pid as warm_serving_pid
from ._watchdog import STOPPED_SENTINEL_SECONDS

__all__ = ["MODES", "Relaunch", "SPARE", "STOPPED_SENTINEL_SECONDS", "WARM_ANSWER_SECONDS", "warm_serving_pid",
           "first_survivor", "is_agreed", "keep_mpi_uninitialized", "lazy_exports", "Setting", "CONFIG_ROWS", "check",
           "fields_match", "read", "text", "write", "fill", "asked", "would_fill"]
