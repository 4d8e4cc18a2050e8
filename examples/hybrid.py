"""Data x pipeline training (``--dp`` replicas of a ``--pp``-stage pipeline, launched with -n dp*pp)
that survives losing ranks, the way back chosen by the library.

Logical rank r holds stage r % pp of replica r // pp (``elastic.mesh.Mesh``). Each replica runs the
pipeline of ``examples/pipeline.py`` (its model, its GPipe step) on its slice of the global batch;
the twins of a stage then average their gradients (``Mesh.allreduce_stage``), so every replica of a
stage stays bitwise equal. ``elastic.pipeline.roll_forward`` applies a step on every rank or on none,
and a lost rank's stage comes back (``StageRebuild``, ``elastic.recovery.plan_mesh_recovery``): from
a live twin, exactly (the run ends bitwise where a failure-free run ends); by CheckFree(+) from the
neighbouring stages when every replica of the stage died; when not even that can rebuild it, every
rank stops with ``Unrecoverable`` naming the stages. After a shrink (``--rebuild shrink``, where
a whole replica is left) the lost ranks' replicas go out of use and the others carry the global
batch; the out-of-use ranks idle to the end.

    python -m elastic.launch -n 4 --spares 1 --inject 1@10 -- python examples/hybrid.py --dp 2 --pp 2
"""
from __future__ import annotations

import argparse
import hashlib
import sys

import torch

import elastic
from elastic.mesh import Mesh, mesh_policy
from elastic.pipeline import StageRebuild, body_grad_norm, roll_forward
from pipeline import Stage, make_text, train_step  # the model and the pipeline step, one replica's


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--checkfree-plus", action="store_true", help="swapped-order micro-batches, end-layer copies")
    parser.add_argument("--average-moments", action="store_true", help="rebuild Adam's moments by CheckFree too")
    for name, default in (("steps", 30), ("batch", 16), ("micro", 4), ("samples", 1024), ("seq", 32), ("vocab", 64),
                          ("dim", 64), ("heads", 4), ("blocks", 1), ("lr", 3e-3), ("seed", 0)):
        parser.add_argument(f"--{name}", type=type(default), default=default)  # batch: global; micro: per replica
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = elastic.init(policy=mesh_policy(args.dp, args.pp, checkfree_plus=args.checkfree_plus))
    mesh = Mesh(world, args.dp, args.pp)
    me, s = int(world.logical_rank), mesh.stage
    text = make_text(args)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    stage = Stage(s, args.pp, args)  # the same initialisation on every replica
    rebuilder = StageRebuild(world, args.pp, plus=args.checkfree_plus, average_moments=args.average_moments,
                             replicas=args.dp)
    run = {"optimizer": torch.optim.Adam(stage.parameters(), lr=args.lr), "gnorm": 1.0, "loss": float("nan")}

    def compute(step: int) -> float:
        replicas = len(mesh.in_use)
        if not mesh.working:  # a shrink took part of this replica: the others carry the batch
            run["loss"] = train_step(world, {}, {}, args.pp, text[:0], args) / replicas  # the loss sum only
            return run["loss"]
        run["optimizer"].zero_grad()
        mine = mesh.shard(batches.batch(step))
        loss = train_step(world, {s: stage}, mesh.stage_hosts(), args.pp, text[torch.from_numpy(mine)], args)
        grads = [p.grad for p in stage.parameters()]
        mesh.allreduce_stage([g.numpy() for g in grads], step)
        for g in grads:
            g.div_(replicas)
        run["loss"] = loss / replicas
        return run["loss"]

    def apply(step: int) -> None:
        if mesh.working:
            run["gnorm"] = body_grad_norm(stage)
            run["optimizer"].step()

    def rebuild(lost: set[int]) -> None:
        run["optimizer"], run["gnorm"] = rebuilder.rebuild(
            lost, me, stage, run["optimizer"], run["gnorm"],
            lambda boost: torch.optim.Adam(stage.parameters(), lr=args.lr * boost))

    steps = roll_forward(world, args.steps, compute, apply, rebuild,
                         after=lambda step: rebuilder.keep_end_copies(stage, me))

    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in stage.state_dict().values())).hexdigest()
    finite = all(bool(torch.isfinite(p).all()) for p in stage.parameters())
    stages = sorted(world.allgather({"replica": mesh.replica, "stage": s, "sha256": digest, "finite": finite}),
                    key=lambda r: (r["replica"], r["stage"]))
    if world.rank == 0:
        in_use = [r for r in stages if r["replica"] in mesh.in_use]
        replicas_equal = all(r["sha256"] == in_use[r["stage"]]["sha256"] for r in in_use)
        model = hashlib.sha256("".join(r["sha256"] for r in in_use[:args.pp]).encode()).hexdigest()
        print(f"[hybrid] {steps} steps, {args.dp} x {args.pp} mesh, replicas in use {mesh.in_use}, "
              f"generation {world.generation}, replicas equal: {replicas_equal}, loss {run['loss']:.6f}")
        print(f"model sha256 {model}")
        world.events.emit("result", steps=steps, stages=in_use, replicas_equal=replicas_equal, sha256=model,
                          in_use=mesh.in_use, final_loss=run["loss"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
