"""A torch DataLoader that follows the world: this rank's share of each global batch, by step.

    sampler = elastic.data.GlobalBatchSampler(world, len(dataset), global_batch, step=lambda: state.step)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    while state.step < total_steps:
        for x, y in loader:          # the rest of the current epoch, from the State's step
            ...
            state.step += 1

Epochs have ``len(dataset) // global_batch`` steps (the last partial batch is
dropped), each in the order of a permutation seeded by ``(seed, epoch)``:
step ``s`` is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``,
cut over the ranks of the current world with ``np.array_split``. So the global
batches, and their order, do not depend on the world size: after a shrink every
step takes the same samples as before, each rank a larger share; after a
roll-back iteration resumes mid-epoch at the restored step.

Across a failure: ``elastic.run`` calls your function again, and iterating the
DataLoader anew starts a new pass of the sampler at the restored step, so what
the old iterator's workers had prefetched (``num_workers > 0``) is dropped
with it; with ``persistent_workers=True`` the workers survive but their queue
is still refilled from the new pass. Each new iterator draws its workers' base
seed from torch's default generator; the sampler puts the generator back as
it was before that draw when the first batch is taken, so the extra iterator a
recovery makes never shifts the program's random numbers (dropout stays
bitwise with a failure-free run). Random transforms in workers are
reproducible across a failure only when they are seeded from the sample or the
step (a worker's seed depends on when the iterator was made).
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
try:
    import torch.utils.data
except ImportError as exc:  # the project's message, not torch's
    from ._needs import torch_missing

    raise torch_missing("elastic.data") from exc

from elastic.comm import ConfigError, Group


class GlobalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """This rank's share of each global batch, from the current step to the end of its epoch.

    Args:
        world: the resilient world (its current size and rank cut each batch).
        num_samples: the data set's length.
        global_batch: samples per step over all ranks, kept after a shrink.
        step: gives the step to start from when iteration begins (``lambda: state.step``).
        seed: the permutations' seed; the same on every rank.
        accumulation: micro-batches per optimizer step: this rank's share of each global batch
            comes as that many pieces in a row (the loop steps the optimizer after each
            ``accumulation``-th, ``no_sync`` for the others). Steps, the State's step and the fault
            schedule's ``R@S`` all count optimizer steps.
        share: this rank's part of a global batch (default: split among the world's ranks, this
            rank's piece); a mesh's ranks that take the same part pass ``Mesh.shard`` (each
            data-parallel replica's piece, alike on its pipeline and tensor-parallel ranks).
    """

    def __init__(self, world: Group, num_samples: int, global_batch: int, *, step: Callable[[], int],
                 seed: int = 0, accumulation: int = 1,
                 share: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        if not 0 < global_batch <= num_samples:
            raise ConfigError(f"global_batch={global_batch} with {num_samples} samples: "
                              "need 0 < global_batch <= samples")
        if accumulation < 1:
            raise ConfigError(f"accumulation={accumulation}: give the micro-batches per optimizer step, >= 1")
        self.world, self.num_samples, self.global_batch, self.seed = world, num_samples, global_batch, seed
        self.accumulation = accumulation
        self.steps_per_epoch = num_samples // global_batch
        self._step = step
        self._share = share
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its permutation), drawn once

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global step ``step``."""
        return divmod(step, self.steps_per_epoch)

    def batch(self, step: int) -> np.ndarray:
        """The sample indices of global batch ``step``, over all ranks (local)."""
        epoch, index = self.epoch_of(step)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return self._order[1][index * self.global_batch:(index + 1) * self.global_batch]

    def shard(self, step: int) -> list[int]:
        """This rank's part of global batch ``step`` in the current world (local)."""
        batch = self.batch(step)
        if self._share is not None:
            return np.asarray(self._share(batch)).tolist()
        return np.array_split(batch, self.world.size)[self.world.rank].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        # A DataLoader makes its iterator by calling this, then draws its workers' base seed from
        # torch's global generator (unless it was given a generator of its own). The loop makes one
        # more iterator after each recovery than a run without failures, so that draw would shift
        # every random number after it (dropout): the first batch puts the generator back.
        return self._batches(torch.get_rng_state())

    def _batches(self, rng: torch.Tensor) -> Iterator[list[int]]:
        torch.set_rng_state(rng)
        start = self._step()
        end = (self.epoch_of(start)[0] + 1) * self.steps_per_epoch
        for step in range(start, end):
            # The fault schedule's R@step, for a loop that marks no steps itself (with prefetching
            # workers the sampler runs ahead of the loop, and so does this point): once per step,
            # at its first micro-batch, so an injection counts optimizer steps as the program does.
            self.world.fault_point(step, implied=True)
            share = self.shard(step)  # cut when it is drawn: a rebuild between steps is taken into account
            for micro, part in enumerate(np.array_split(np.asarray(share, dtype=np.int64), self.accumulation)):
                self.world.fault_point(step, micro=micro)  # R@S.M: the schedule's micro-batch M of step S
                yield part.tolist()

    def __len__(self) -> int:
        """The batches left in the current epoch (micro-batches, with accumulation)."""
        return (self.steps_per_epoch - self.epoch_of(self._step())[1]) * self.accumulation
