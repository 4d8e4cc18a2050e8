"""examples/store_demo.py where logical rank 0 corrupts the copies it holds of one rank's state.

    CORRUPT_OWNER=1 CORRUPT_AT=5 python tests/programs/corrupt_store.py --replication 3

Once version CORRUPT_AT is committed, logical rank 0 flips a byte in every piece
it holds of logical rank CORRUPT_OWNER's payload (a silent memory error): the
store must detect it by checksum and fetch those chunks from another holder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import store_demo  # noqa: E402  (examples/store_demo.py)

from elastic.recovery import ReplicatedStore  # noqa: E402

OWNER, AT = int(os.environ["CORRUPT_OWNER"]), int(os.environ["CORRUPT_AT"])
_commit = ReplicatedStore.commit


def commit(self: ReplicatedStore, state, version: int) -> None:
    _commit(self, state, version)
    if version == AT and self.world.logical_rank == 0:
        self._sums.settle()  # the holder's checksums (taken in the background) come first, as for a real flip
        for (owner, _, _), held in sorted(self._chain.current.held.items()):
            if owner == OWNER and held.data.nbytes:
                held.data[0] ^= 0xFF  # in the store's own memory, as a bit flip would be


ReplicatedStore.commit = commit  # type: ignore[method-assign]
sys.exit(store_demo.main())
