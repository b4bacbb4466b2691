"""The two forms of DAR's gate and transport (``depthrewrite.passes.dar.MIX_FORM``): as
differences, autograd forms one sum over the tokens per scalar use, the spec's form two
(each such sum is a split reduction over every element in the compiled step, which reads
its tensors again); both give the same gradients. Counted in the eager backward: the sums
that reduce a ``(batch, tokens, d)`` tensor to one or two numbers."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import depthrewrite
from depthrewrite.models.gpt import GPT, GPTConfig
from depthrewrite.passes import dar
from tests.unit.test_schemes_routed import randomize_routing

D, LAYERS, BATCH, TOKENS = 32, 4, 2, 8


class ScalarSums(TorchDispatchMode):
    """Counts the sums of a ``(BATCH, TOKENS, D)`` tensor down to at most two numbers
    (``count``), and those down to one number per token (``rows``)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.sum and tuple(args[0].shape) == (BATCH, TOKENS, D):
            self.count += out.numel() <= 2
            self.rows += tuple(out.shape) == (BATCH, TOKENS, 1)
        return out


def _backward_sums(form: str, layers_per_block: int, two_phase: bool, monkeypatch,
                   per_token: bool = False) -> tuple["ScalarSums", torch.Tensor, dict]:
    monkeypatch.setattr(dar, "MIX_FORM", form)
    monkeypatch.setattr(dar, "PER_TOKEN_SCALARS", per_token)
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=D, n_layer=LAYERS, n_head=2, max_seq_len=TOKENS))
    model = depthrewrite.rewrite(model, "dar", layers_per_block=layers_per_block, two_phase=two_phase)
    randomize_routing(model)  # every scalar away from its initial value, so that each sum matters
    idx = torch.randint(0, model.config.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    counter = ScalarSums()
    with counter:
        loss.backward()
    return counter, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("layers_per_block,two_phase", [(1, True), (2, True), (2, False)])
def test_one_sum_per_scalar_use_and_the_same_gradients(layers_per_block, two_phase, monkeypatch):
    sums, loss, grads = _backward_sums("difference", layers_per_block, two_phase, monkeypatch)
    sums_w, loss_w, grads_w = _backward_sums("weights", layers_per_block, two_phase, monkeypatch)
    sums, sums_w = sums.count, sums_w.count
    sites, blocks = 2 * LAYERS, LAYERS // layers_per_block
    later_sites = sites - blocks  # the sites that transport their block's partial entries
    gates = sites + 1  # every site's and the readout's mix
    # difference form: each write sums once for rho and once per beta, each gate once
    assert sums == later_sites * 3 + blocks * 2 + gates
    # the spec's form: rho's two weights in two products each, and both weights of the gate
    assert sums_w == later_sites * 6 + blocks * 2 + gates * 2
    # float32: the two forms differ by rounding only
    torch.testing.assert_close(loss, loss_w, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_w.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_w[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("form", ["weights", "difference"])
@pytest.mark.parametrize("layers_per_block,two_phase", [(2, True), (2, False)])
def test_per_token_scalars_sum_each_row_first(form, layers_per_block, two_phase, monkeypatch):
    """With ``dar.PER_TOKEN_SCALARS`` no gradient sums a whole stream to a number: each
    scalar use sums every token's row instead (one row sum more for each whole sum of the
    form without it; the norms' backwards make the others), then the tokens; the
    gradients are the same up to rounding."""
    plain, loss, grads = _backward_sums(form, layers_per_block, two_phase, monkeypatch)
    per_token, loss_t, grads_t = _backward_sums(form, layers_per_block, two_phase, monkeypatch, per_token=True)
    assert plain.count > 0 and per_token.count == 0
    assert per_token.rows - plain.rows == plain.count
    torch.testing.assert_close(loss_t, loss, rtol=1e-6, atol=1e-6)
    assert grads_t.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_t[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_an_unknown_form_is_refused(monkeypatch):
    model = depthrewrite.rewrite(GPT(GPTConfig(d_model=D, n_layer=2, n_head=2, max_seq_len=TOKENS)), "dar")
    monkeypatch.setattr(dar, "MIX_FORM", "sums")
    idx = torch.zeros(1, TOKENS, dtype=torch.long)
    with pytest.raises(ValueError, match=r"dar.MIX_FORM must be one of weights, difference, found 'sums'"):
        model(idx, idx)
