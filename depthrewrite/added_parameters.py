"""The parameters a rewrite added, for a training loop's optimizer groups.

A rewritten model's routing parameters are ordinary parameters, so ``model.parameters()``
holds them and any optimizer trains them. Rules that group parameters by shape catch some
of them by accident: nanoGPT's ``configure_optimizers`` decays every parameter of two or
more dimensions, and Muon-style optimizers orthogonalize them, which takes in DAR's
``(2, d)`` per-stream queries and key-norm weights and Hyper-Connections' and mHC's mixing
matrices and projections, while the other schemes' routing vectors escape. These functions
name the routing parameters so that a loop can give them a rule of their own (the training
harness gives them no weight decay: ``depthrewrite/train/optimizer.py``).
"""

from __future__ import annotations

from torch import nn

from .passes.runtime import routed_modules, routing_parameters as _routers_parameters


def named_routing_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter the rewrite added (those under a routed
    module's ``depth_route``), named and ordered as ``model.named_parameters()`` names and
    orders them (so through a ``torch.compile`` wrapper, with its ``_orig_mod.`` prefix).
    Empty for schemes without parameters (``residual``). Raises ``DepthRewriteError`` for a
    model that is not rewritten: an optimizer built from it would miss the parameters a
    later rewrite adds."""
    routed_modules(model, "named_routing_parameters")
    added = {id(p) for p in _routers_parameters(model)}
    return [(name, p) for name, p in model.named_parameters() if id(p) in added]


def routing_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of :func:`named_routing_parameters`, without their names."""
    return [p for _, p in named_routing_parameters(model)]
