"""torchrun's conventions under elastic: ``torch.distributed.init_process_group()`` with no
rendezvous of its own makes the World's group.

A light module: ``elastic.init`` installs this for every torch program, and the group's module
(``_process_group``) is imported only when a program makes the group; ``elastic.distributed``
(DCP, DTensor: ~0.6 s to import) never by this, nor after a spare's promotion.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from elastic.comm import ConfigError, World

from ._mpigroup import BACKEND

_ORIGINAL_INIT = dist.distributed_c10d.init_process_group
_SERVED: list[Any] = []  # the World whose group a bare init_process_group() makes, then that ProcessGroup


def serve_init_process_group(world: World) -> None:
    """Make ``torch.distributed.init_process_group()`` without a rendezvous of its own (no
    ``init_method``, ``store``, ``rank`` or ``world_size``: what torchrun-style programs call, and
    what FSDP2 calls when it finds no default group) install ``ProcessGroup(world)`` instead of
    reading ``MASTER_ADDR``, which nothing sets here (local; ``elastic.init`` calls it). Its
    ``backend``: none, ``"gloo"`` or torch's default give this machine's default (``ulfm`` on
    CPU: Gloo cannot leave a collective whose peer died; ``nccl`` where CUDA is); ``"nccl"``
    gives NCCL. A call with a rendezvous of its own is torch's, unchanged."""
    _SERVED[:] = [world]
    dist.init_process_group = dist.distributed_c10d.init_process_group = _init_process_group


def _init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None, world_size: int = -1,
                        rank: int = -1, store: Any = None, *args: Any, **kwargs: Any) -> None:
    if not _SERVED or init_method is not None or store is not None or world_size != -1 or rank != -1:
        return _ORIGINAL_INIT(backend, init_method, timeout, world_size, rank, store, *args, **kwargs)
    name = str(backend).lower() if backend is not None else None
    if name not in (None, "gloo", "nccl", BACKEND, "cpu:gloo,cuda:nccl"):
        raise ConfigError(f"init_process_group(backend={backend!r}) under elastic: give no backend (the World's "
                          f"{BACKEND!r} group on CPU, NCCL on GPUs), or make the group with "
                          "elastic.distributed.ProcessGroup(world, backend=...)")
    from ._process_group import ProcessGroup  # here: not at the start of a program that makes no group

    seconds = timeout.total_seconds() if timeout is not None else 60.0
    group = ProcessGroup(_SERVED[0], backend="nccl" if name == "nccl" else None, timeout=seconds)
    group.group  # noqa: B018  (Gloo's and NCCL's meet here; the ulfm group is made already)
    _SERVED[1:] = [group]
