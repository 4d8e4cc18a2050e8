"""``TorchState``: a ``State`` that also holds torch models, their optimizers and the RNG states."""
from __future__ import annotations

import weakref
from typing import Any, Mapping

from elastic.comm import ConfigError, Recoverable
from elastic.recovery import Adopt

from ._handlers import Held, Module, Rng, Stateful
from ._points import Twins
from ._state import State

# Optimizers whose step() is a per-step recovery point: they fire the ``update`` fault point
# themselves, once the point passed (``State.step_point``); any other fires it as its step begins.
POINTED: weakref.WeakSet[Any] = weakref.WeakSet()


class TorchState(State):
    """Torch models, their optimizers, the RNG states and any scalars, committed together.

    ``model`` / ``optimizer`` are stored as ``model.*`` / ``optim.*``; more
    pairs go in ``modules={"name": (model, optimizer)}`` as ``name.model.*`` /
    ``name.optim.*`` (a rank hosting several pipeline stages, say). Model
    parameters and buffers and, unless ``shard_optimizer``, optimizer state
    must be equal on every rank (data parallel) unless named in ``local``;
    the RNG states (``rng.*``: torch, numpy, python) are per rank.
    Data-loader position is a scalar such as ``step`` (see ``GlobalBatches``).
    Each is a handler of its kind (``_handlers``: ``Module``, ``Stateful``,
    ``Rng``), like the program's values. After a shrink, a pair taken over
    from a removed rank is held as arrays until ``bind(name, model,
    optimizer)`` loads it (see ``unbound()``). With ``per_step=True`` every
    optimizer's ``step()`` is a recovery point (``step_point`` runs just before it); with a sharded
    optimizer that needs ``twins`` (``State``): the optimizer's state is then twinned, held alike by
    the ranks of its shard, as are the values named in ``twinned`` (the shard's master weights).
    """

    def __init__(self, world: Recoverable, *, model: Any = None, optimizer: Any = None,
                 modules: Mapping[str, tuple[Any, Any]] | None = None, shard_optimizer: bool = False,
                 replication: int | None = None, redundancy: str | None = None, local: tuple[str, ...] = (),
                 chunk_bytes: int = 1 << 20, adopt: Adopt | None = None, per_step: bool = False,
                 keep_versions: int | None = None, twins: Twins | None = None, twinned: tuple[str, ...] = (),
                 **values: Any) -> None:
        local = tuple(local) + ("rng",) + (("optim",) if shard_optimizer and twins is None else ())
        twinned = tuple(twinned) + (("optim",) if shard_optimizer and twins is not None else ())
        if per_step and shard_optimizer and twins is None:
            raise ConfigError("per_step=True with shard_optimizer=True: a step point comes before the optimizer "
                              "step, and a sharded optimizer's state changes in it, after the point, where nothing "
                              "else holds it; give twins=elastic.mesh.Mesh(world, r, n // r) (each shard held by r "
                              "ranks that apply the same update, examples/zero1.py), or use per_step=False "
                              "(commit() every few steps)")
        super().__init__(world, replication=replication, redundancy=redundancy, local=local, chunk_bytes=chunk_bytes,
                         adopt=adopt, per_step=per_step, keep_versions=keep_versions, twins=twins, twinned=twinned,
                         **values)
        self._per_step = per_step
        self._hooked: tuple[str, Any, Any] | None = None  # per_step: the optimizer's name, its hook's handle, it
        pairs = {"": (model, optimizer)} if model is not None or optimizer is not None else {}
        for name, (module, optim) in {**pairs, **(modules or {})}.items():
            self.bind(name, module, optim)
        self._values.own("rng", Rng())

    def bind(self, name: str, model: Any, optimizer: Any = None) -> None:
        """Host one more (model, optimizer) pair as ``name`` ("" for ``model`` / ``optimizer``),
        loading the values this rank took over for it, if any (local)."""
        pre = f"{name}." if name else ""
        for key, obj, handler in ((f"{pre}model", model, Module), (f"{pre}optim", optimizer, Stateful)):
            if obj is None:
                continue
            if key in self._values.public:
                raise ConfigError(f"state value {key!r} is the program's; TorchState keeps the model and the "
                                  "optimizer under that name: rename the value")
            held = self._values.handlers.get(key)
            self._values.handlers[key] = handler(obj)
            if isinstance(held, Held):
                self._values.handlers[key].apply(key, held.value)
            if handler is Stateful and self._per_step:
                self._hook(key, obj)

    def _hook(self, name: str, optimizer: Any) -> None:
        """Make ``optimizer.step()`` call ``step_point`` first (``per_step``; binding another
        optimizer under the same name unhooks the last)."""
        if self._hooked is not None and self._hooked[0] != name:
            raise ConfigError("per_step=True takes one optimizer: its step() is each step's recovery "
                              "point; with more, make the TorchState with per_step=False, or a State "
                              "with per_step=True and call state.step_point() before the first update")
        if self._hooked is not None:
            self._hooked[1].remove()  # bound again (a model built anew after a shrink): the new one's
            POINTED.discard(self._hooked[2])
        self._hooked = (name, optimizer.register_step_pre_hook(lambda *_: self.step_point()), optimizer)
        POINTED.add(optimizer)

    def _recover(self) -> None:
        for handler in self._values.handlers.values():
            if isinstance(handler, Module):
                end_iteration(handler.value)
        super()._recover()

    def unbound(self) -> list[str]:
        """Names of model/optimizer pairs this rank holds values of but no module for (adopted ones)."""
        return sorted(n.removesuffix(".model") for n, h in self._values.handlers.items()
                      if isinstance(h, Held) and h.label == Module.label and n.endswith(".model"))


def end_iteration(model: Any) -> None:
    """What a failure in the middle of a step leaves in a model, gone (local): FSDP2's per-iteration
    state (its own ``reset_iter_state``, on the root, once a forward made it) and every gradient,
    the unsharded ones FSDP2 keeps for the parameters its root unit owns included (torch 2.13's
    reset leaves them, and the next backward would add to them: a transformer's embedding, final
    norm and head). Gradients are not state: a step redone computes them again."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        state = model._get_fsdp_state()
        if hasattr(getattr(state, "_comm_ctx", None), "all_gather_state"):  # made at the first forward
            model.reset_iter_state()
        for unit in state._state_ctx.all_states:
            for group in unit._fsdp_param_groups:
                for param in group.fsdp_params:
                    if getattr(param, "_unsharded_param", None) is not None:
                        param._unsharded_param.grad = None
                    param.unsharded_accumulated_grad = None
    for parameter in model.parameters():
        parameter.grad = None
