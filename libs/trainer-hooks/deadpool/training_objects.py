"""The user's training objects, generation after generation: the model as built, the wrapped model the
step calls, the optimizer, and the registered objects bound to it.

The model and a factory-built optimizer are per generation: a wrapper (DDP, FSDP2) and a sharded
optimizer (ZeroRedundancyOptimizer) need the generation's process group, and a spare has none until
it holds a rank. `build` makes them over a new group without adopting them; the rebuild adopts them
once their state is loaded (`adopt`), and leaving a group drops them (`drop`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from deadpool.ddp_check import check_wrapped
from deadpool.errors import MemberCannotContinueError, RendezvousFailedError
from deadpool.noting_group import FailureNote, NotingGroup, skip_step_after_failure
from deadpool.sharded_module import fresh_copy, is_fully_sharded, meta_template
from deadpool.user_state import UserState
from deadpool_protocol import MemberErrorCause

__all__ = ["NotesFailures", "OptimizerFactory", "TrainingObjects", "Wrapper", "own_optimizer"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Wrapper = Callable[[nn.Module, Any], nn.Module]


@runtime_checkable
class NotesFailures(Protocol):
    """A wrapper that wants the group whose failures are noted rather than raised (`noting_group`):
    a failed collective then ends the step in a recovery, and the loop needs no `with job.step()`.
    `deadpool.ddp` is one."""

    notes_failures: bool

    def __call__(self, module: nn.Module, group: Any) -> nn.Module: ...


class TrainingObjects:
    """The model, the wrapped model and the optimizer of the current generation (see the module's doc)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        wrap: Wrapper | None,
        state: UserState,
        on_optimizer_step: Callable[[], None],
        log: Any,
    ) -> None:
        self.own_optimizer = own_optimizer(module, optimizer)
        """The user's optimizer, kept for the whole run, when one was given rather than a factory."""
        self.factory: OptimizerFactory | None = None if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        self.wrap = wrap
        self.module = module
        """The unwrapped model; its parameters are what snapshots hold (a fresh copy per generation
        once `fully_shard` sharded it)."""
        self.model: Any = module
        """The model the step calls: the wrapped one while this member holds a rank."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.state = state
        self.note = FailureNote()
        """Collective failures of the current step that did not raise (see `noting_group`)."""
        self.param_device = next(iter(module.parameters()), torch.empty(0)).device
        """Where the model's parameters live (a fresh copy of a sharded model is materialised there)."""
        self._template: nn.Module | None = None
        """The model on the meta device, as the user built it: each generation's fresh copy to shard (FSDP2)."""
        self._template_made = False
        self.warmed = False
        """A spare's rehearsal (`warm_up`) ran."""
        self._hooked: torch.optim.Optimizer | None = None
        """The optimizer whose step pre-hook fences snapshot copies (hooked once per optimizer)."""
        self._on_optimizer_step = on_optimizer_step
        self._log = log

    def group_for_wrap(self, group: Any) -> Any:
        """What the wrapper gets: for a wrapper that notes failures, the group that notes them."""
        notes = isinstance(self.wrap, NotesFailures) and self.wrap.notes_failures
        return NotingGroup(group, self.note) if notes else group

    def module_to_wrap(self) -> tuple[nn.Module, bool]:
        """The module the next wrap gets, and whether it is a fresh copy: the model itself, unless
        `fully_shard` sharded it over an older group (see `sharded_module`)."""
        if not self._template_made:  # the first wrap: keep a template of the model as the user built it
            self._template_made = True
            try:
                self._template = meta_template(self.module)
            except Exception as exc:  # an FSDP job then cannot rebuild; it says so when it must
                self._log.info("no meta template of the model", error=repr(exc)[:300])
            return self.module, False
        if not is_fully_sharded(self.module):
            return self.module, False
        if self._template is None:
            raise MemberCannotContinueError(
                MemberErrorCause.USER_CODE, "the model is sharded with fully_shard, and it could not be deep-copied"
            )
        return fresh_copy(self._template), True

    def warm_up(self, group: Any) -> None:
        """A spare's rehearsal: wrap and build the optimizer once over `group` (a one-process group),
        then drop them, so that the imports and lazy initialisation are paid before a rank is given."""
        module, _ = self.module_to_wrap()
        wrapped = self.wrap(module, self.group_for_wrap(group)) if self.wrap else module
        if self.factory is not None:  # the user's own optimizer is left alone
            optimizer = self.factory(list(self.module.parameters()))
            self.state.bind(optimizer)
            del optimizer
        del wrapped
        gc.collect()
        self.warmed = True

    def build(self, group: Any, fill_fresh: Callable[[nn.Module], None]) -> tuple[Any, torch.optim.Optimizer]:
        """The wrapped model and the optimizer of a new generation's `group`, not adopted yet.

        `fill_fresh` gives a fresh copy of a sharded model its state. Raises RendezvousFailedError if
        the group broke while the wrapper was built (DDP's checks and broadcast note a failure without
        raising); whatever the user's wrapper or factory raises is raised as it is."""
        module, fresh = self.module_to_wrap()
        self.note.clear()
        model = self.wrap(module, self.group_for_wrap(group)) if self.wrap else module
        if self.note.error is not None:
            raise RendezvousFailedError(f"the new group broke while wrapping: {self.note.error}")
        check_wrapped(model)
        if is_fully_sharded(module) and self.own_optimizer is not None:
            raise TypeError("a model sharded with fully_shard needs an optimizer factory: its parameters change")
        if fresh:
            fill_fresh(module)
        self.module = module
        optimizer = self.factory(list(module.parameters())) if self.factory else self.own_optimizer
        assert optimizer is not None
        self.state.bind(optimizer)  # before the optimizer's state is loaded: see `user_state`
        return model, optimizer

    def hook(self, optimizer: torch.optim.Optimizer) -> None:
        """Fence snapshot copies before each optimizer step, and skip the step after a noted failure
        (once per optimizer: the user's own is hooked once for the whole run)."""
        if optimizer is self._hooked:
            return
        optimizer.register_step_pre_hook(lambda *_: self._on_optimizer_step())
        skip_step_after_failure(optimizer, self.note)
        self._hooked = optimizer

    def adopt(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def drop(self) -> None:
        """Let go of the generation's wrapper and optimizer (they hold its process group)."""
        self.model = self.module
        self.optimizer = self.own_optimizer


def own_optimizer(
    module: nn.Module, optimizer: OptimizerFactory | torch.optim.Optimizer
) -> torch.optim.Optimizer | None:
    """The user's own optimizer, checked, if `optimizer` is one rather than a factory."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError("optimizer must be an optimizer over the model's parameters, or a factory of one")
        return None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(
            "a ZeroRedundancyOptimizer needs each generation's process group: pass a factory "
            "(optimizer=lambda params: ZeroRedundancyOptimizer(params, ...)) and the job builds it"
        )
    own = {id(p) for p in module.parameters()}
    if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's: build it over model.parameters()")
    return optimizer
