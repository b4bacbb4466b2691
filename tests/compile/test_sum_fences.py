"""The backend's bounded gradient sums (:mod:`depthrewrite.sum_fences`): fences land after
every ``max_terms`` terms of a long chain of additions, the fenced graph computes the same
sum, and a rewritten model compiled with Inductor through the fences matches eager."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import depthrewrite
from depthrewrite import backend, sum_fences
from depthrewrite.models.gpt import gpt_from_preset

FENCE = torch.ops.depthrewrite.fence_.default
ADD = torch.ops.aten.add.Tensor


def _chain(n: int, shape=(256, 256)):
    def f(*xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = acc + x
        return acc

    xs = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    return make_fx(f)(*xs), xs


def _terms_per_piece(graph: torch.fx.Graph) -> list[int]:
    """Terms summed by each fused piece: a piece ends at a fence or at the chain's end."""
    pieces, terms = [], {}
    for node in graph.nodes:
        if node.target is ADD:
            terms[node] = sum(1 if any(u.target is FENCE for u in a.users) else terms.get(a, 1) for a in node.args)
            if any(u.target is FENCE for u in node.users) or not any(u.target is ADD for u in node.users):
                pieces.append(terms[node])
    return pieces


@pytest.mark.parametrize("n,max_terms,fences", [(11, 4, 3), (11, 2, 9), (4, 4, 0), (5, 4, 1), (40, 8, 5)])
def test_fences_bound_every_piece_and_keep_the_sum(n, max_terms, fences):
    gm, xs = _chain(n)
    expected = gm(*xs)
    assert sum_fences.fence_gradient_sums(gm.graph, max_terms) == fences
    gm.recompile()
    assert sum(node.target is FENCE for node in gm.graph.nodes) == fences
    pieces = _terms_per_piece(gm.graph)
    assert max(pieces) <= max_terms
    # the first piece has max_terms terms, each later one the running sum plus new terms
    assert sum(pieces) - (len(pieces) - 1) == n
    # same additions in the same order: bit for bit
    assert torch.equal(gm(*xs), expected)


def test_small_tensors_and_branching_sums_are_left_alone():
    gm, _ = _chain(12, shape=(4, 4))  # a parameter-sized sum
    assert sum_fences.fence_gradient_sums(gm.graph, 2) == 0

    def tree(a, b, c, d, e):
        ab = a + b
        return ab + c + d + e, ab * 2  # ab has two users: it is a term of its own

    xs = [torch.randn(256, 256) for _ in range(5)]
    gm = make_fx(tree)(*xs)
    # ab + c + d + e: the chain after ab has 4 terms (ab counted once): fenced only below 4
    assert sum_fences.fence_gradient_sums(gm.graph, 4) == 0
    gm = make_fx(tree)(*xs)
    assert sum_fences.fence_gradient_sums(gm.graph, 3) == 1


@pytest.mark.parametrize("bad", [1, 0, True, 2.0, "4"])
def test_bad_max_terms_is_refused(bad):
    gm, _ = _chain(5)
    with pytest.raises(ValueError, match="max_terms"):
        sum_fences.fence_gradient_sums(gm.graph, bad)
    with pytest.raises(ValueError, match="max_sum_terms"):
        backend.depthrewrite_backend(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [torch.randn(1, 2)],
                                     options={"max_sum_terms": bad})


def _dar_model():
    """One layer: its gradient sums are long enough to be fenced at max_sum_terms=2, and
    Inductor compiles it on the CPU in half the time of two (CI's suite, session 48)."""
    torch.manual_seed(0)
    model = depthrewrite.rewrite(gpt_from_preset("tiny", n_layer=1), "dar").train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_inductor_through_fences_matches_eager_and_user_passes_run_after_them(monkeypatch):
    """DAR (the scheme with the longest sums) compiled with Inductor on the CPU, with the
    size threshold lowered so that the tiny model's sums are fenced too, matches eager; a
    user's own ``post_grad_custom_post_pass`` (here a list of two) runs after the fences.
    One compilation for both: on the CPU it takes most of a minute."""
    monkeypatch.setattr(sum_fences, "MIN_NUMEL", 0)
    seen = []

    def user_pass(name):
        def run(graph):
            seen.append((name, sum(n.target is FENCE for n in graph.nodes)))
        return run

    model = _dar_model()
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        _, loss = fn(idx, idx)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_grads(model)
    torch._dynamo.reset()
    backend.clear_reports()
    # a fresh compilation, so that the pass runs here (the report counts its fences)
    compiled = torch.compile(model, backend="depthrewrite", fullgraph=True,
                             options={"max_sum_terms": 2, "force_disable_caches": True,
                                      "post_grad_custom_post_pass": [user_pass("a"), user_pass("b")]})
    loss, grads = loss_and_grads(compiled)
    report = backend.last_report()
    assert report.max_sum_terms == 2 and report.fences["backward"] > 0
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # forward then backward, each user pass given the graph with its fences in
    assert seen == [("a", report.fences["forward"]), ("b", report.fences["forward"]),
                    ("a", report.fences["backward"]), ("b", report.fences["backward"])]
