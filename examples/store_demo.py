"""Replicated in-memory state: every rank commits versions of its arrays; killed ranks get theirs back.

Each version's content is a pure function of (logical rank, version), so after
a recovery every rank checks, bit for bit, that what the store gave back is
exactly what the dead rank had committed.

    python -m elastic.launch -n 4 --spares 1 --inject 1@5 -- python examples/store_demo.py
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

import elastic
from elastic.recovery import ReplicatedStore


def state_of(logical: int, version: int, floats: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([logical, version])
    return {"weights": rng.standard_normal(floats), "moments": rng.standard_normal((3, floats // 3)).astype(np.float32),
            "step": np.array([version], dtype=np.int64)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--floats", type=int, default=300_000, help="float64 values in 'weights' per rank")
    parser.add_argument("--replication", type=int, default=2)
    parser.add_argument("--chunk-bytes", type=int, default=256 * 1024)
    parser.add_argument("--no-rollback-copy", action="store_true",
                        help="the store keeps no copy of its own (each version's arrays are never changed here)")
    args = parser.parse_args()

    world = elastic.init()
    store = ReplicatedStore(world, replication=args.replication, chunk_bytes=args.chunk_bytes,
                            rollback_copy=not args.no_rollback_copy)
    version = 0
    checks: list[dict] = []
    needs_recovery = world.role is elastic.Role.RECOVERED
    while True:
        try:
            if needs_recovery:
                store.recover()
                needs_recovery = False
                version = store.version
                for owner in store.owners_here():
                    expected = state_of(owner, version, args.floats)
                    got = store.restore_owner(owner)
                    ok = sorted(got) == sorted(expected) and all(
                        got[k].dtype == expected[k].dtype and got[k].tobytes() == expected[k].tobytes()
                        for k in expected)
                    checks.append({"owner": owner, "version": version, "ok": ok})
                    world.events.emit("verified", owner=owner, version=version, ok=ok)
            if version == args.versions:
                all_checks = world.allgather(checks)
                world.finish()
                break
            world.fault_point(version)
            store.commit(state_of(int(world.logical_rank), version + 1, args.floats), version + 1)
            version += 1
        except elastic.ProcessFailure:
            world.recover()
            needs_recovery = True

    if world.rank == 0:
        flat = [c for rank_checks in all_checks for c in rank_checks]
        print(f"[store] version {version} on {world.size} ranks (generation {world.generation}); "
              f"verified {sum(c['ok'] for c in flat)}/{len(flat)} restored states bit for bit", flush=True)
        world.events.emit("result", version=version, size=world.size, generation=world.generation,
                          logical_ranks=[int(r) for r in world.logical_ranks], checks=flat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
