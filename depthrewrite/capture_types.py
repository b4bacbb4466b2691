"""The records of a capture run: one module call (``ModuleCall``), where a block receives
the stream (``StreamArg``), and the small queries over recorded calls that both the
capture (``depthrewrite.capture``) and its refusals (``depthrewrite.capture_refusals``)
use. Kept apart from both so that neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


@dataclass
class ModuleCall:
    """One recorded call of a module during the capture run."""

    order: int
    module: nn.Module
    args: tuple
    kwargs: dict
    output: Any = None


@dataclass
class StreamArg:
    """Where a block receives the stream: a positional index or a keyword name."""

    position: int | None = None
    keyword: str | None = None

    def get(self, args: tuple, kwargs: dict) -> Any:
        if self.keyword is not None:
            return kwargs[self.keyword]
        return args[self.position]

    def replace(self, args: tuple, kwargs: dict, value: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``value`` where the stream was."""
        if self.keyword is not None:
            return args, {**kwargs, self.keyword: value}
        return args[:self.position] + (value,) + args[self.position + 1:], kwargs

    def describe(self) -> str:
        return f"keyword '{self.keyword}'" if self.keyword is not None else f"argument {self.position}"


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a (possibly nested) output, in pytree order."""
    return next((leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)), None)


def first_tensor_arg(call: ModuleCall) -> StreamArg | None:
    """Where ``call`` received its first floating-point tensor argument (positional first)."""
    for i, a in enumerate(call.args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return StreamArg(position=i)
    for k, v in call.kwargs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return StreamArg(keyword=k)
    return None


def children_in_call_order(container: nn.Module, first_call: dict[nn.Module, ModuleCall]) -> list[tuple[str, nn.Module]]:
    called = [(name, child) for name, child in container.named_children() if child in first_call]
    return sorted(called, key=lambda nc: first_call[nc[1]].order)


def calls_after_stack(calls: list[ModuleCall], block_calls: list[ModuleCall]) -> list[ModuleCall]:
    """The module calls after the last block starts, outside every block."""
    inside_blocks = set()
    for c in block_calls:
        inside_blocks.update(c.module.modules())
    last = block_calls[-1].order
    return [c for c in calls if c.order > last and c.module not in inside_blocks]
