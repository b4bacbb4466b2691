"""Blocks compiled one at a time, as torchtitan compiles a model: each ``TransformerBlock``
compiled with the backend, either in place (``block.compile(...)``) or replaced by its
compiled wrapper (``torch.compile(block)`` registered back), the rest of the model eager.

A rewritten block's call carries the depth state in and out (docs/design.md, "The
runtime"), so each compiled block must see it as the whole-model compile does: the loss
and every gradient equal eager's, one graph per block with ``fullgraph=True`` and none
compiled again on the next step, and every routing call a block makes eagerly is in that
block's graph (the readout's, made by the final norm, stays eager)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import depthrewrite
from depthrewrite import backend

from tests.handwritten_models import TitanLlama

LAYERS = 4
SCHEMES = {"block_attnres": {}, "attnres": {}, "dar": {}, "wav": {}, "mhar": {"heads": 4}}


class BlockRoutingCalls(TorchDispatchMode):
    """Counts the ``depthrewrite::`` routing calls below autograd, by the block running
    (None: outside every block)."""

    def __init__(self):
        super().__init__()
        self.block: str | None = None
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "depthrewrite" and name in ("route", "route_many", "route_merge"):
            self.calls[(self.block, f"depthrewrite::{name}")] += 1
        return func(*args, **(kwargs or {}))


def _model(scheme: str) -> TitanLlama:
    torch.manual_seed(0)
    model = TitanLlama(n_layers=LAYERS)
    depthrewrite.rewrite(model, scheme, example_inputs=(torch.randint(0, 128, (2, 8)),), **SCHEMES[scheme])
    with torch.no_grad():  # routing parameters off their init, so the softmax is not uniform
        for name, p in model.named_parameters():
            if name.endswith(("query", "key_norm_weight")):
                p.add_(torch.randn_like(p), alpha=0.5)
    return model


def _step(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    # a wrapped block's parameters are named through its `_orig_mod`
    return loss.detach(), {n.replace("._orig_mod", ""): p.grad.clone() for n, p in model.named_parameters()}


def _eager_calls_per_block(model, tokens, form: str) -> dict:
    """The routing calls of an eager forward, by the block whose compiled region makes them:
    its ``forward`` with hooks (``_call_impl``) when compiled in place, its whole call when
    wrapped (a routed block's ``__call__`` passes the depth state in and out around it)."""
    counter = BlockRoutingCalls()
    names = {layer: name for name, layer in model.layers.items()}

    def attributed(call):
        def run(self, *args, **kwargs):
            outer, counter.block = counter.block, names.get(self, counter.block)
            try:
                return call(self, *args, **kwargs)
            finally:
                counter.block = outer
        return run

    attribute = "_call_impl" if form == "in place" else "__call__"
    classes = {type(layer) for layer in model.layers.values()}
    originals = {cls: cls.__dict__.get(attribute) for cls in classes}
    for cls in classes:
        setattr(cls, attribute, attributed(getattr(cls, attribute)))
    try:
        with torch.no_grad(), counter:
            model(tokens)
    finally:
        for cls, original in originals.items():
            if original is None:
                delattr(cls, attribute)
            else:
                setattr(cls, attribute, original)
    per_block = collections.defaultdict(dict)
    for (block, op), n in counter.calls.items():
        per_block[block][op] = n
    return per_block


def _compile_blocks(model, form: str) -> None:
    options = {"inner": "aot_eager"}
    for name, layer in list(model.layers.items()):
        if form == "in place":
            layer.compile(backend="depthrewrite", fullgraph=True, options=options)
        else:
            model.layers.register_module(name, torch.compile(layer, backend="depthrewrite", fullgraph=True,
                                                             options=options))


@pytest.mark.parametrize("form", ["in place", "wrapped"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_blocks_compiled_one_at_a_time_match_eager_and_lower_their_routing(scheme, form):
    model = _model(scheme)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = _eager_calls_per_block(model, tokens, form)
    eager_loss, eager_grads = _step(model, tokens)

    torch._dynamo.reset()
    backend.clear_reports()
    _compile_blocks(model, form)
    loss, grads = _step(model, tokens)
    reports = backend.reports()
    assert len(reports) == LAYERS  # one graph per block
    _step(model, tokens)
    assert len(backend.reports()) == LAYERS  # the next step compiles nothing again

    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # block k's graph (blocks compile in call order) holds exactly the calls block k makes eagerly
    assert [r.ops for r in reports] == [expected.get(name, {}) for name in model.layers]
    assert sum(sum(r.ops.values()) for r in reports) > 0
