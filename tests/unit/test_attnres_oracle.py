"""The rewritten bundled GPT equals an independently hand-written AttnRes GPT."""

import pytest
import torch

import depthrewrite
from depthrewrite.models import gpt_from_preset
from tests.attnres_oracle import attnres_gpt_logits


def routing_params(model):
    """(query, key_norm_weight) per site in site order, then the readout's."""
    params = []
    for block in model.blocks:
        for name in sorted(block.depth_route, key=lambda n: int(n.removeprefix("site"))):
            r = block.depth_route[name]
            params.append((r.query, r.key_norm_weight))
    r = model.norm_final.depth_route["readout"]
    return params + [(r.query, r.key_norm_weight)]


def randomize_routing(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "depth_route" in name:
                p.copy_(torch.randn(p.shape, generator=gen) + (1.0 if name.endswith("key_norm_weight") else 0.0))


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("scheme, block_size", [("attnres", None), ("block_attnres", 2), ("block_attnres", 3)])
def test_rewrite_matches_hand_written_attnres_gpt(parallel, scheme, block_size):
    torch.manual_seed(0)
    model = gpt_from_preset("tiny", n_layer=3, parallel_block=parallel).eval()
    ids = torch.randint(0, 256, (2, 11))
    options = {"block_size": block_size} if block_size else {}
    depthrewrite.rewrite(model, scheme, **options)
    randomize_routing(model)
    with torch.no_grad():
        got = model(ids)
        want = attnres_gpt_logits(model, routing_params(model), ids, block_size=block_size)
        other = {None: 2, 2: None, 3: 2}[block_size]
        plain = attnres_gpt_logits(model, routing_params(model), ids, block_size=other)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)  # the oracle tells block sizes apart
