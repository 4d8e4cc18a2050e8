"""examples/train.py sharded with FSDP2 (``fully_shard``) on the World's process group; its
sharded state saved with torch.distributed.checkpoint into peers' memory.

Each rank holds a quarter of every layer's parameters and of AdamW's moments
(FSDP2 all-gathers a layer for its forward and backward and reduce-scatters its
gradients, all on the ``ulfm`` group: a death ends those collectives at once).
Every ``--commit-every`` steps the program saves its state dict with DCP, as
it would to disk, into ``elastic.distributed.PeerMemory(state)``, and commits:
each rank's shards are replicated to its peers, never the whole model. After a
failure the library ends the iteration the failure cut short (FSDP2's
per-iteration state, every gradient), the loop calls ``train`` again, and DCP
loads the checkpoint back.

    python -m elastic.launch -n 4 --spares 1 --inject 1@20 -- python examples/fsdp.py --steps 40
    python -m elastic.launch -n 4 --rebuild shrink --inject 3@20 -- python examples/fsdp.py --steps 40

A spare (or a spawned process) gets the lost rank's shards back: the final
model and optimizer are bitwise those of a failure-free run. After a shrink the
model is sharded again over the survivors and DCP re-shards the 4-rank
checkpoint onto 3 ranks; the global batches stay the same.

``--replicas R`` (R >= 2): HSDP instead, ``fully_shard`` over a 2-D (replicate,
shard) ``DeviceMesh`` of the ``ulfm`` group: R instances of n / R ranks, each
shard held by one rank of each (its twins, which FSDP2's all-reduce across the
replicate dimension gives the same gradient bits). Every step a recovery point
at no copy (``TorchState(per_step=True, shard_optimizer=True, twins=mesh)``): a
replacement takes its parameter and optimizer shards from its twin, bitwise; no
DCP checkpoint is needed.

    python -m elastic.launch -n 4 --spares 1 --inject 1@20 -- python examples/fsdp.py --steps 40 --replicas 2

A shrink takes the lost rank's instance out of use (``Hsdp``).
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import numpy as np
import torch
import torch._dynamo  # noqa: F401  (FSDP2 imports it on first use: 0.7 s a parked spare pays before, not after, a failure)
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, _init_optim_state, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import elastic
import elastic.distributed
from elastic.mesh import Mesh, mesh_policy
from train import add_arguments, digest, make_model, report, setup, step_done, step_tally


class Checkpointable:
    """The model and optimizer as DCP saves and loads them (torch's own pattern)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class Hsdp:
    """``--replicas R``: HSDP, each shard kept by its twins, every step a recovery point.

    The model is sharded over the instances in use: a 2-D (replicate, shard) ``DeviceMesh`` of the
    ``ulfm`` group, made again for each shape of the World. A shrink takes the lost rank's instance
    out of use: the instances left carry the global batch, and a surviving rank of the instance
    taken out computes nothing but keeps its shards in step, twin to the end: its twin in use sends
    it the step's reduced gradient shard and it takes the same optimizer step."""

    def __init__(self, args: argparse.Namespace, world: elastic.World) -> None:
        self.args, self.world = args, world
        self.group = elastic.distributed.ProcessGroup(world)
        self.twins = Mesh(world, args.replicas, world.job.initial_size // args.replicas)  # k: (k // pp, k % pp)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.size = 0  # the World's size the model is sharded for
        self.build()

    def build(self) -> None:
        """The model sharded over the instances in use, its shards (and the optimizer's) those this
        rank held, if any; a rank of an instance out of use keeps what it has."""
        twins = self.twins
        self.group.group  # noqa: B018  (the default group of this shape, which the mesh's groups divide)
        hosts = [[twins.rank_of(d, s) for s in range(twins.pp)] for d in twins.in_use]
        mesh = DeviceMesh("cpu", torch.tensor(hosts), mesh_dim_names=("replicate", "shard"))  # every rank makes it
        self.size = self.world.size
        if not twins.working:
            return
        with torch.random.fork_rng():  # make_model seeds: keep this rank's dropout stream
            model = make_model(self.args)
        for layer in model:
            if isinstance(layer, torch.nn.Linear) and not (self.args.root_params and layer is model[-1]):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # with --root-params the root unit holds the head's parameters
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.args.lr)
        _init_optim_state(optimizer)  # torch's own (DCP's loader does it): the state a twin's is copied into
        if self.model is not None and self.optimizer is not None:  # the same local shards, on the new mesh
            with torch.no_grad():
                for new, old in zip(model.parameters(), self.model.parameters()):
                    new.to_local().copy_(old.to_local())
                    for key, value in self.optimizer.state[old].items():  # moments (sharded), step counts
                        mine = optimizer.state[new][key]
                        if hasattr(value, "to_local"):
                            mine.to_local().copy_(value.to_local())
                        else:
                            mine.copy_(value)
        self.model, self.optimizer = model, optimizer

    def pass_gradients(self, step: int) -> None:
        """Each stage's reduced gradient shard, from its twin in the first instance in use to the
        surviving ranks of the instances out of use (point to point; none before a shrink)."""
        twins, world = self.twins, self.world
        idle = [(rank, int(k)) for rank, k in enumerate(world.logical_ranks) if int(k) // twins.pp not in twins.in_use]
        if not idle:
            return
        assert self.model is not None
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_local().detach().numpy())
        if twins.working and twins.replica == twins.in_use[0]:
            world.neighbors([(rank, i, g) for rank, k in idle if k % twins.pp == twins.stage
                             for i, g in enumerate(grads)], [], step)
        elif not twins.working:
            sender = twins.rank_of(twins.in_use[0], twins.stage)
            world.neighbors([], [(sender, i, g) for i, g in enumerate(grads)], step)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> int:
        args, world, twins = self.args, self.world, self.twins
        assert self.model is not None and self.optimizer is not None
        state = elastic.TorchState(world, model=self.model, optimizer=self.optimizer, per_step=True,
                                   shard_optimizer=True, twins=twins, twinned=("model",),
                                   replication=args.replication, step=0, loss=float("nan"))
        batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
        hashes: dict[str, str] = {}

        @elastic.run
        def train(world: elastic.World, state: elastic.TorchState) -> float:
            if self.size != world.size:  # a shrink: the instances left, on a mesh of their own
                self.build()
                if twins.working:
                    state.bind("", self.model, self.optimizer)
            model, optimizer = self.model, self.optimizer
            assert model is not None and optimizer is not None
            while state.step < args.steps:
                world.fault_point(state.step)
                working = [twins.rank_of(d, s) for d in twins.in_use for s in range(twins.pp)]
                mine, share = np.array([], np.int64), torch.zeros(())
                if twins.working:
                    optimizer.zero_grad(set_to_none=True)  # the root's unsharded gradients too
                    mine = np.array_split(batches.batch(state.step), len(working))[working.index(world.rank)]
                    idx = torch.from_numpy(mine)
                    share = torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum")
                    # FSDP2 averages over the mesh: reduce-scatter over the shard dimension, all-reduce over twins
                    (share * len(working) / args.batch).backward()
                self.pass_gradients(state.step)
                tally = step_tally(world, float(share.detach()), mine, args)
                optimizer.step()  # the step point first (TorchState's hook): from there the step is local
                step_done(state, tally, args)
            if twins.working:  # collective over the mesh: its ranks gather the whole model
                full = StateDictOptions(full_state_dict=True)
                hashes.update(model_sha256=digest(get_model_state_dict(model, options=full)),
                              optimizer_sha256=digest(get_optimizer_state_dict(model, optimizer, options=full)))
            return state.loss

        loss = train(world, state)
        told = next(h for h in world.allgather(hashes) if h)  # from the ranks in use
        report(world, state, loss, **told)
        return 0


def rehearse_hsdp(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> None:
    """``--rehearse``: a spare's HSDP set-up and first step before it parks, on the rehearsal's
    default group of the job's size (``elastic.init(rehearse=...)``)."""
    n = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(n).reshape(args.replicas, n // args.replicas),
                      mesh_dim_names=("replicate", "shard"))
    with torch.random.fork_rng():
        model = make_model(args)
    for layer in model:
        if isinstance(layer, torch.nn.Linear) and not (args.root_params and layer is model[-1]):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.nn.functional.mse_loss(model(x[:8]), y[:8], reduction="sum").backward()
    optimizer.step()


def hsdp(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> int:
    """``--replicas R``: HSDP (``Hsdp``)."""
    rehearse = functools.partial(rehearse_hsdp, args, x, y) if args.rehearse else None
    world = elastic.init(policy=mesh_policy(args.replicas, copies=True), rehearse=rehearse)
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    return Hsdp(args, world).train(x, y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--root-params", action="store_true",
                        help="--replicas: leave the head in the root unit (a transformer's root owns its embedding, "
                             "final norm and head), as the official FSDP2 example does")
    parser.add_argument("--rehearse", action="store_true", help="--replicas: a spare rehearses its first step")
    parser.add_argument("--replicas", type=int, default=1,
                        help="HSDP: instances, each shard held by one rank of each (1: FSDP2 over every rank)")
    args = parser.parse_args()
    x, y, _ = setup(args)  # the data; the model is sharded for each world size below
    if args.replicas > 1:
        return hsdp(args, x, y)
    world = elastic.init()
    torch.manual_seed(1000 + int(world.logical_rank or 0))  # dropout masks differ per rank (restored per rank)
    group = elastic.distributed.ProcessGroup(world)
    state = elastic.TorchState(world, local=("dcp",), replication=args.replication, step=0, loss=float("nan"))
    checkpoint = elastic.distributed.PeerMemory(state)
    batches = elastic.GlobalBatches(args.samples, args.batch, args.seed)
    job: dict[str, Any] = {}

    def shard() -> None:
        """A fresh model sharded over this world (the same initial values everywhere), and AdamW."""
        group.group  # noqa: B018  (the default group of this generation, which the mesh takes)
        with torch.random.fork_rng():  # make_model seeds: keep this rank's dropout stream
            model = make_model(args)
        mesh = init_device_mesh("cpu", (world.size,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        job.update(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr), size=world.size,
                   fresh=True)

    @elastic.run
    def train(world: elastic.World, state: elastic.TorchState) -> float:
        if state.step == 0:  # the start, or a roll-back to it: the initial model
            if not job.get("fresh"):
                shard()
        else:  # a roll-back to a commit: its checkpoint, re-sharded by DCP if the world changed size
            if job.get("size") != world.size:
                shard()
            dcp.load({"app": Checkpointable(job["model"], job["optimizer"])}, storage_reader=checkpoint)
        model, optimizer = job["model"], job["optimizer"]
        while state.step < args.steps:
            job["fresh"] = False
            world.fault_point(state.step)
            optimizer.zero_grad()
            mine = batches.shard(state.step, world)
            idx = torch.from_numpy(mine)
            share = torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum")
            (share * world.size / args.batch).backward()  # FSDP2 reduce-scatters the mean gradient in here
            tally = step_tally(world, float(share.detach()), mine, args)
            optimizer.step()
            step_done(state, tally, args)
            if state.step % args.commit_every == 0:
                dcp.save({"app": Checkpointable(model, optimizer)}, storage_writer=checkpoint)
                state.commit()
        full = StateDictOptions(full_state_dict=True)  # collective: every rank gathers the whole model
        job["model_sha256"] = digest(get_model_state_dict(model, options=full))
        job["optimizer_sha256"] = digest(get_optimizer_state_dict(model, optimizer, options=full))
        return state.loss

    loss = train(world, state)
    report(world, state, loss, model_sha256=job["model_sha256"], optimizer_sha256=job["optimizer_sha256"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
