"""Blocks compiled one at a time, as torchtitan compiles a model: each ``TransformerBlock``
compiled with the backend, either in place (``block.compile(...)``) or replaced by its
compiled wrapper (``torch.compile(block)`` registered back), the rest of the model eager;
and, as torchtitan's activation checkpointing does, each block's call checkpointed
(``checkpoint_wrapper``) under those compiles or the whole model's.

A rewritten block's call carries the depth state in and out (docs/design.md, "Rewrite:
class swap, functional depth state"), so each compiled block must see it as the
whole-model compile does: the loss and every gradient equal eager's, one graph per block
with ``fullgraph=True`` and none compiled again on the next step, and every routing call a
block makes eagerly is in that block's graph (the readout's, made by the final norm, stays
eager). On a GPU (the device machine) the same through Inductor and the fused kernels."""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import depthrewrite
from depthrewrite import backend
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.conftest import free_port, hf_model, perturb_routing
from tests.handwritten_models import TitanLlama

#: three blocks: the first (which opens the depth state), one between, and the last (whose
#: outputs reach the readout); four until session 65 (each block compiled costs seconds)
LAYERS = 3
SCHEMES = {"block_attnres": {}, "attnres": {}, "dar": {}, "wav": {}, "mhar": {"heads": 4}}
#: the backend's options on the CPU: AOTAutograd without code generation (tests/compile/test_backend.py)
AOT_EAGER = {"inner": "aot_eager"}


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


def _model(scheme: str, layers: int = LAYERS) -> TitanLlama:
    torch.manual_seed(0)
    model = TitanLlama(n_layers=layers)
    depthrewrite.rewrite(model, scheme, example_inputs=(torch.randint(0, 128, (2, 8)),), **SCHEMES[scheme])
    perturb_routing(model)  # off their init, so that the softmax is not uniform
    return model


def _step(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), _grads_by_plain_name(model)


def _grads_by_plain_name(model) -> dict:
    """Every gradient, named as in the model before its modules were wrapped: a compiled
    module names its parameters through its ``_orig_mod``, a checkpoint wrapper through its
    ``_checkpoint_wrapped_module``."""
    return {n.replace("_orig_mod.", "").replace("._checkpoint_wrapped_module", ""): p.grad.clone()
            for n, p in model.named_parameters()}


def _assert_matches_eager(loss, grads, eager_loss, eager_grads, atol: float = 1e-6) -> None:
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=atol)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=atol, msg=name)


def _eager_calls_per_block(model, tokens, form: str) -> dict:
    """The routing calls of an eager forward, by the block whose compiled region makes them:
    its ``_call_impl`` (hooks, then ``forward``) when compiled in place, its whole call when
    wrapped (a routed block's ``__call__`` passes the depth state in and out around it, and
    starts it at the first block)."""
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


def _compile_blocks(model, form: str, options: dict | None = AOT_EAGER, isolate_recompiles: bool = False) -> None:
    # passed only when asked for: not every supported torch's torch.compile takes it
    isolated = {"isolate_recompiles": True} if isolate_recompiles else {}
    for name, layer in list(model.layers.items()):
        if form == "in place":
            layer.compile(backend="depthrewrite", fullgraph=True, options=options, **isolated)
        else:
            model.layers.register_module(name, torch.compile(layer, backend="depthrewrite", fullgraph=True,
                                                             options=options, **isolated))


#: every scheme in place; replaced by its wrapper, DAR (every scheme is compiled wrapped in
#: test_checkpointed_block_calls_compile_fullgraph_with_side_effects_allowed)
ONE_AT_A_TIME_RUNS = [(scheme, "in place") for scheme in SCHEMES] + [("dar", "wrapped")]


@pytest.mark.parametrize("scheme,form", ONE_AT_A_TIME_RUNS)
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

    _assert_matches_eager(loss, grads, eager_loss, eager_grads)
    # block k's graph (blocks compile in call order) holds exactly the calls block k makes eagerly
    assert [r.ops for r in reports] == [expected.get(name, {}) for name in model.layers]
    assert sum(sum(r.ops.values()) for r in reports) > 0


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("scheme", ["dar", "wav"])
def test_a_block_call_sets_no_attribute_of_the_block(scheme, compiled):
    """What a block's call hands its ``forward`` (the depth state's pytree spec, and back the
    new state's) travels with the call (``runtime.DepthCall``), not as attributes of the
    block: compiled block by block, every attribute the call set was a side effect that
    Dynamo replayed after the graph on every call, rebuilding the spec node by node (some
    1,600 bytecode instructions a call for a DAR block of a 24-layer model)."""
    model = _model(scheme)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    if compiled:
        torch._dynamo.reset()
        _compile_blocks(model, "in place")
    _step(model, tokens)

    def attributes():
        return {name: {k: id(v) for k, v in vars(layer).items()} for name, layer in model.layers.items()}

    before = attributes()
    _step(model, tokens)
    assert attributes() == before


#: Dynamo's recompile limit (graphs per code object) in the tests that compile more blocks
#: than it: 2, not torch's 8, so that 4 blocks pass it (each block compiled costs a test
#: seconds); what they check, a code object of each block's own, holds at any limit
RECOMPILE_LIMIT = 2

#: torch.compile's own per-call cache (torch 2.13 has it; not every supported torch does)
ISOLATES_RECOMPILES = "isolate_recompiles" in inspect.signature(torch.compile).parameters


@pytest.mark.parametrize("form", ["in place", "wrapped", "checkpointed", "checkpointed, isolated"])
def test_more_blocks_than_dynamos_recompile_limit_each_get_their_graph(form):
    """Each block routes over its own number of sources, so each needs its own graph; with
    one code object for all blocks, Dynamo's recompile limit (8 graphs per code object by
    default; RECOMPILE_LIMIT here) stopped the block past it (an error with
    ``fullgraph=True``): each block has its own (``runtime.block_class``). A block wrapped
    in ``checkpoint_wrapper`` is compiled through the wrapper's ``forward``, torch's code
    shared by every wrapper: there the limit must be raised to the number of blocks, or
    each block compiled with ``isolate_recompiles=True`` where torch has it, as the README
    says."""
    if form == "checkpointed, isolated" and not ISOLATES_RECOMPILES:
        pytest.skip(f"torch {torch.__version__}'s torch.compile has no isolate_recompiles")
    layers = RECOMPILE_LIMIT + 2
    model = _model("block_attnres", layers)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = _step(model, tokens)
    torch._dynamo.reset()
    backend.clear_reports()
    checkpointed = form.startswith("checkpointed")
    if checkpointed:
        _checkpoint_blocks(model)
    settings = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True} if checkpointed else {}
    settings["recompile_limit"] = layers if form == "checkpointed" else RECOMPILE_LIMIT
    with torch._dynamo.config.patch(**settings):
        _compile_blocks(model, "wrapped" if checkpointed else form,
                        isolate_recompiles=form == "checkpointed, isolated")
        loss, grads = _step(model, tokens)
    assert len(backend.reports()) == layers
    _assert_matches_eager(loss, grads, eager_loss, eager_grads)


def _checkpoint_blocks(model) -> None:
    for name, layer in list(model.layers.items()):
        model.layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))


#: each block compiled, every scheme; the model compiled whole, the two-phase schemes (whose
#: phase 1 nests a checkpoint of its own in the block's)
CHECKPOINTED_RUNS = [(scheme, "each block") for scheme in SCHEMES] + [(s, "the model") for s in ("block_attnres", "dar")]


@pytest.mark.parametrize("scheme,compiled", CHECKPOINTED_RUNS)
def test_checkpointed_block_calls_compile_fullgraph_with_side_effects_allowed(scheme, compiled):
    """A checkpoint around each block's call updates the depth runtime inside the
    checkpointed region, which Dynamo traces only with
    ``skip_fwd_side_effects_in_bwd_under_checkpoint``; then the compiled model matches
    eager, one graph per compiled module. The two-phase schemes (Block AttnRes, DAR) nest
    their phase 1's own checkpoint inside the block's (``two_phase._seen_outside``)."""
    model = _model(scheme)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = _step(model, tokens)
    _checkpoint_blocks(model)
    torch._dynamo.reset()
    backend.clear_reports()
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        if compiled == "each block":
            _compile_blocks(model, "wrapped")
            run = model
        else:
            run = torch.compile(model, backend="depthrewrite", fullgraph=True, options=AOT_EAGER)
        for _ in range(2):  # the second step runs the same graphs
            loss, grads = _step(run, tokens)
    assert len(backend.reports()) == (LAYERS if compiled == "each block" else 1)
    _assert_matches_eager(loss, grads, eager_loss, eager_grads)
    assert sum(sum(r.ops.values()) for r in backend.reports()) > 0


def _after_an_eager_step(scheme: str, checkpointed: bool, device: str = "cuda") -> tuple:
    """The model on ``device``, the tokens, and the eager step's loss and gradients; then
    each block checkpointed where asked, Dynamo and the backend's reports cleared."""
    model = _model(scheme).to(device)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    eager_loss, eager_grads = _step(model, tokens)
    if checkpointed:
        _checkpoint_blocks(model)
    torch._dynamo.reset()
    backend.clear_reports()
    return model, tokens, eager_loss, eager_grads


def _compiled_sharded_steps(model, tokens, checkpointed: bool, process_backend: str) -> tuple:
    """torchtitan's order on one rank: each block compiled with the backend's defaults
    (Inductor), then each block and the model sharded with FSDP2; two steps. The second
    step's loss and its gradients, gathered whole."""
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group(process_backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                         world_size=1)
    try:
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointed):
            _compile_blocks(model, "wrapped", options=None)  # the backend's defaults
            for layer in model.layers.values():
                fully_shard(layer)
            fully_shard(model)
            for _ in range(2):
                loss, grads = _step(model, tokens)
    finally:
        torch.distributed.destroy_process_group()
    return loss, {name: g.full_tensor() for name, g in grads.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the device machine)")
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_on_the_gpu_blocks_compiled_through_inductor_run_the_fused_kernels_and_match_eager(scheme, checkpointed):
    """torchtitan's set-up on a GPU, float32: each block (checkpointed or not) compiled
    with the backend's defaults (Inductor), eager running the fused kernels too."""
    model, tokens, eager_loss, eager_grads = _after_an_eager_step(scheme, checkpointed)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=checkpointed):
        _compile_blocks(model, "wrapped", options=None)  # the backend's defaults
        for _ in range(2):
            loss, grads = _step(model, tokens)
    reports = backend.reports()
    assert len(reports) == LAYERS
    assert {impl for r in reports for impl in r.implementation.values()} == {"triton"}
    _assert_matches_eager(loss, grads, eager_loss, eager_grads, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the device machine)")
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("scheme", ["block_attnres", "dar"])
def test_on_the_gpu_blocks_sharded_with_fsdp2_run_phase_one_and_match_eager(scheme, checkpointed):
    """torchtitan's whole set-up on a GPU, one rank, float32: each block (checkpointed or
    not) compiled with the backend's defaults, then sharded with FSDP2, so that phase 1
    reads the next block's routing parameters as shards and gathers them
    (depthrewrite.fsdp2). Loss and every gradient match the same model's eager step
    without FSDP2, and the block graphs hold phase 1's route_many calls on the kernels."""
    model, tokens, eager_loss, eager_grads = _after_an_eager_step(scheme, checkpointed)
    loss, grads = _compiled_sharded_steps(model, tokens, checkpointed, "nccl")
    ops = backend.lowered_ops()
    assert ops.get("depthrewrite::route_many (triton)", 0) > 0, ops  # phase 1 ran on the shards
    _assert_matches_eager(loss, grads, eager_loss, eager_grads, atol=1e-5)


def test_blocks_sharded_with_fsdp2_through_inductor_on_the_cpu_match_eager():
    """The same on the CPU for DAR (gloo, Inductor's C++ code, the reference routing ops;
    Block AttnRes, whose phase 1 is DAR's with one stream, ran here too until session 65:
    30 s of CI's time). Under
    FSDP2 Dynamo makes the int attributes of the modules it manages symbolic inputs once
    two blocks have shown two values; a block that stored its index + 1 as the next
    block's made Inductor's code return a symbol it never defined (NameError, found on the
    device's GPU). The tests with AOTAutograd alone generate no code, and passed."""
    model, tokens, eager_loss, eager_grads = _after_an_eager_step("dar", checkpointed=False, device="cpu")
    loss, grads = _compiled_sharded_steps(model, tokens, False, "gloo")
    ops = backend.lowered_ops()
    assert ops.get("depthrewrite::route_many (reference)", 0) > 0, ops  # phase 1 ran on the shards
    _assert_matches_eager(loss, grads, eager_loss, eager_grads, atol=1e-5)


@pytest.mark.parametrize("scheme", ["dar"])
def test_a_hugging_face_model_compiled_layer_by_layer_past_the_recompile_limit(scheme):
    """A transformers Llama with more decoder layers than Dynamo's recompile limit, each
    layer compiled alone (the layers take keyword arguments: position embeddings, masks,
    the cache): one graph per layer, loss and gradients equal eager's. DAR, the scheme
    whose blocks carry the most state (Block AttnRes and WAV ran here too until session
    65; each block's code object of its own is checked on every form, Block AttnRes, by
    test_more_blocks_than_dynamos_recompile_limit_each_get_their_graph)."""
    layers = RECOMPILE_LIMIT + 2
    model = depthrewrite.rewrite(hf_model("llama", layers=layers), scheme).train()
    perturb_routing(model)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), _grads_by_plain_name(model)

    eager_loss, eager_grads = step()
    torch._dynamo.reset()
    backend.clear_reports()
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer, backend="depthrewrite", fullgraph=True, options=AOT_EAGER)
        loss, grads = step()
    assert len(backend.reports()) == layers
    _assert_matches_eager(loss, grads, eager_loss, eager_grads)
