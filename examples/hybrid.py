"""Data x pipeline training (``--dp`` replicas of a ``--pp``-stage pipeline, launched with -n dp*pp)
that survives losing ranks, the way back chosen by the library.

The program of ``examples/pipeline.py`` (its model, its GPipe step, its loop) with two replicas by
default. Logical rank r holds stage r % pp of replica r // pp (``elastic.mesh.Mesh``); each replica
trains on its slice of the global batch and the twins of a stage average their gradients
(``Mesh.allreduce_stage``), so every replica of a stage stays bitwise equal. A lost rank's stage
comes back (``StageRebuild``, ``elastic.recovery.plan_mesh_recovery``): from a live twin, exactly
(the run ends bitwise where a failure-free run ends); where every replica of the stage died, from
the store's last commit, every rank rolling back to it (``--commit-every``, exact); by CheckFree(+)
from the neighbouring stages for a stage whose copies died too; when not even that can rebuild
it, every rank stops with ``Unrecoverable`` naming the stages. After a shrink (``--rebuild
shrink``, where a whole replica is left) the lost ranks' replicas go out of use and the others
carry the global batch; the out-of-use ranks idle to the end.

    python -m elastic.launch -n 4 --spares 1 --inject 1@10 -- python examples/hybrid.py --dp 2 --pp 2
"""
from __future__ import annotations

import sys

from pipeline import main

if __name__ == "__main__":
    sys.exit(main(dp=2, pp=2))
