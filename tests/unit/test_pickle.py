"""A rewritten model pickles whole (``torch.save(model)``, ``torch.multiprocessing``) and
copies (``copy.deepcopy``, an EMA copy), and what comes back computes bit for bit what the
original did: its blocks' classes and rewritten programs are made again from the original
classes and the programs' source (depthrewrite/passes/program_source.py)."""

import copy
import io

import pytest
import torch
from torch import nn

import depthrewrite
from depthrewrite.errors import DepthRewriteError
from depthrewrite.models import GPT, GPTConfig
from depthrewrite.models.gpt import Block
from depthrewrite.passes.runtime import original_class, routing_parameters
from tests.conftest import HF_FAMILIES, hf_model, perturb_routing

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))


def saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def tiny_gpt(scheme):
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_head=4, n_layer=4, max_seq_len=32))
    depthrewrite.rewrite(model, scheme)
    perturb_routing(model)
    return model


def loss_and_grads(model):
    model.train().zero_grad()
    logits = model(IDS)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), IDS.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scheme", list(depthrewrite.SCHEMES))
def test_a_pickled_model_loads_back_and_computes_the_same_bit_for_bit(scheme):
    model = tiny_gpt(scheme)
    loaded = saved_and_loaded(saved_and_loaded(model))  # a loaded model pickles again
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS), model.eval()(IDS))
    loss, grads = loss_and_grads(model)
    loaded_loss, loaded_grads = loss_and_grads(loaded)
    assert torch.equal(loaded_loss, loss)
    assert grads.keys() == loaded_grads.keys()
    assert any("depth_route" in n for n in grads) == bool(routing_parameters(model))  # none for `residual`
    assert all(torch.equal(loaded_grads[n], g) for n, g in grads.items())
    assert depthrewrite.inspect(loaded).rewritten_with == depthrewrite.inspect(model).rewritten_with
    # the copy's parameters are its own, and its blocks are still the model's own class
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), loaded.parameters()))
    assert isinstance(loaded.blocks[0], Block) and original_class(loaded.blocks[0]) is Block
    assert type(loaded.blocks[0]).__name__ == type(model.blocks[0]).__name__


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_a_pickled_hugging_face_model_loads_back_with_its_interface(family):
    model = depthrewrite.rewrite(hf_model(family), "block_attnres", block_size=2)
    perturb_routing(model)
    loaded = saved_and_loaded(model)
    with torch.no_grad():
        assert torch.equal(loaded(IDS % 97).logits, model(IDS % 97).logits)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(loaded.generate(IDS[:, :3] % 97, **kw), model.generate(IDS[:, :3] % 97, **kw))


def test_a_model_passes_through_the_pickler_of_torch_multiprocessing():
    """torch.multiprocessing sends a model to another process with its ForkingPickler, its
    tensors in shared memory (loaded here in the same process, as the receiver would)."""
    import pickle

    import torch.multiprocessing  # noqa: F401  registers the shared-memory reductions
    from multiprocessing.reduction import ForkingPickler

    model = tiny_gpt("wav").eval()
    received = pickle.loads(ForkingPickler.dumps(model))
    assert received.blocks[0].depth_route["site1"].query.is_shared()
    with torch.no_grad():
        assert torch.equal(received(IDS), model(IDS))


def test_a_loaded_model_compiles_with_the_backend_and_matches_eager():
    loaded = saved_and_loaded(tiny_gpt("dar")).eval()
    with torch.no_grad():
        eager = loaded(IDS)
        compiled = torch.compile(loaded, backend="depthrewrite", fullgraph=True)(IDS)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_a_copy_has_block_classes_of_its_own():
    """Dynamo keeps compiled graphs, and counts recompilations, per code object (see
    depthrewrite/passes/runtime.py): a copy's blocks (an EMA model's), compiled one by one,
    must not count against the original's limit."""
    model = tiny_gpt("block_attnres")
    copied = copy.deepcopy(model)
    for a, b in zip(model.blocks, copied.blocks):
        assert type(a) is not type(b) and type(a).__call__.__code__ is not type(b).__call__.__code__
        assert original_class(b) is Block
    with torch.no_grad():
        assert torch.equal(copied.eval()(IDS), model.eval()(IDS))


DOUBLE = lambda x: 2 * x  # noqa: E731  a leaf of the trace (below) that pickle cannot name
torch.fx.wrap("DOUBLE")


class LambdaBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.proj = nn.RMSNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + DOUBLE(self.proj(self.norm(x)))


class LambdaLM(nn.Module):
    def __init__(self, d=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(LambdaBlock(d) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, 256)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_a_program_calling_what_pickle_cannot_name_is_refused_by_block():
    model = depthrewrite.rewrite(LambdaLM(), "attnres", example_inputs=(IDS,))
    refusal = r"block 'blocks\.\d' cannot be pickled: its rewritten code calls \S*test_pickle\.<lambda>, .*state_dict"
    with pytest.raises(DepthRewriteError, match=refusal):
        torch.save(model, io.BytesIO())
    copy.deepcopy(model)  # a copy shares the programs' code: no source needed


def test_a_class_made_on_top_of_a_routed_block_is_kept_by_a_copy():
    """FSDP2's ``fully_shard`` swaps a module's class for one made on top of it at run time;
    a copy keeps that class (Python's default) rather than the routed class alone."""
    model = tiny_gpt("attnres")

    class Wrapped:
        pass

    block = model.blocks[1]
    block.__class__ = type("Wrapped" + type(block).__name__, (Wrapped, type(block)), {})
    copied = copy.deepcopy(model)
    assert type(copied.blocks[1]) is type(block) and type(copied.blocks[0]) is not type(model.blocks[0])
    with torch.no_grad():
        assert torch.equal(copied.eval()(IDS), model.eval()(IDS))
