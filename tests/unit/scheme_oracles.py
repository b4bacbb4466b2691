"""Hand-written MHAR, WAV and DAR GPTs: test oracles for the rewriter (docs/spec.md sections 4-7).

Written from docs/spec.md alone, independently of ``depthrewrite.passes``: each oracle walks the
bundled GPT's blocks, calls their norms, attention and MLP modules directly, and does the
routing by hand with ``route_reference`` (plain torch). Routing parameters are looked up by
the names the rewritten model gives them (``blocks.<b>.depth_route.site<p>.<field>`` and
``norm_final.depth_route.readout.<field>``), so a test copies them in by name.

``delta=True`` is docs/spec.md section 7: the residual stream ``h`` is kept and each branch reads
``h + gate * route(...)`` (the routing parameters then sit under ``...inner.``).
"""

from __future__ import annotations

import math

import torch

from depthrewrite.ops import route_reference


class Params:
    """Routing parameters of a rewritten model, by name."""

    def __init__(self, model, delta: bool = False):
        self.named = {n: p for n, p in model.named_parameters() if "depth_route" in n}
        self.delta = delta

    def site(self, block: int, position: int, field: str) -> torch.Tensor:
        return self._get(f"blocks.{block}.depth_route.site{position}", field)

    def readout(self, field: str) -> torch.Tensor:
        return self._get("norm_final.depth_route.readout", field)

    def _get(self, prefix: str, field: str) -> torch.Tensor:
        if self.delta and field != "gate":
            prefix += ".inner"
        return self.named[f"{prefix}.{field}"]


def layers(block, rope):
    """A bundled GPT block as a list of sites, each ``(norm, [(part kind, part fn), ...])``."""
    attn = ("attention", lambda n: block.attn(n, rope))
    mlp = ("mlp", block.mlp)
    if hasattr(block, "norm_attn"):
        return [(block.norm_attn, [attn]), (block.norm_mlp, [mlp])]
    return [(block.norm, [attn, mlp])]


def sites(gpt, ids):
    """Yield ``(block index, position, norm, parts)`` for every site, in order; start with
    ``embed``, finish with ``head``."""
    T = ids.shape[1]
    rope = (gpt.rope_cos[:T], gpt.rope_sin[:T])
    for b, block in enumerate(gpt.blocks):
        for p, (norm, parts) in enumerate(layers(block, rope), start=1):
            yield b, p, norm, parts


def embed(gpt, ids):
    return gpt.drop(gpt.embed(ids) * gpt.config.embed_scale)


def head(gpt, x):
    return gpt.lm_head(gpt.norm_final.forward(x))  # forward: the norm itself, not the routed call


class Stream:
    """The branch input: the routed value, or ``h + gate * routed`` in delta mode."""

    def __init__(self, e, params: Params):
        self.h, self.params = e, params

    def site_input(self, routed, b, p):
        if not self.params.delta:
            return routed
        return self.h + self.params.site(b, p, "gate") * routed

    def readout_input(self, routed):
        if not self.params.delta:
            return routed
        return self.h + self.params.readout("gate") * routed

    def add(self, u):
        self.h = self.h + u


# ----------------------------------------------------------------------------- MHAR
def mhar_logits(gpt, params: Params, ids, heads: int, block_size: int | None = None, eps: float = 1e-6):
    """docs/spec.md section 4 over the sources of section 2 (``block_size=None``) or section 3."""
    e = embed(gpt, ids)
    stream = Stream(e, params)
    completed, partial, index = [e], None, 0

    def mix(q, g):
        pool = completed + ([partial] if partial is not None else [])
        return route_reference(pool, query=q, key_norm_weight=g, heads=heads, eps=eps)

    for b, p, norm, parts in sites(gpt, ids):
        index += 1
        x = stream.site_input(mix(params.site(b, p, "query"), params.site(b, p, "key_norm_weight")), b, p)
        u = sum(fn(norm(x)) for _, fn in parts)
        stream.add(u)
        partial = u if partial is None else partial + u
        if block_size is None or index % block_size == 0:
            completed.append(partial)
            partial = None
    x = stream.readout_input(mix(params.readout("query"), params.readout("key_norm_weight")))
    return head(gpt, x)


# ------------------------------------------------------------------------------ WAV
def _rms(t):
    return t.detach().square().mean(-1, keepdim=True).sqrt()


def wav_logits(gpt, params: Params, ids, block_size: int, rho: float = 2.0, eps: float = 1e-6,
               phase_of_parts: bool = True):
    """docs/spec.md section 5. A block is a dict of its bases ``C``, ``phase``, ``split``. With
    ``phase_of_parts=False`` a parallel site contributes 0 to the phase basis (a graph
    that does not expose its parts)."""
    e = embed(gpt, ids)
    stream = Stream(e, params)
    completed, partial, index = [], None, 0
    half = math.ceil(block_size / 2)

    def matched(block, basis):  # ~D = D * min(rho, sg(rms(C)) / (sg(rms(D)) + eps))
        factor = torch.clamp(_rms(block["C"]) / (_rms(block[basis]) + eps), max=rho)
        return block[basis] * factor

    for b, p, norm, parts in sites(gpt, ids):
        index += 1
        pool, bias = [e], [0.0]
        bias_phase, bias_split = params.site(b, p, "detail_bias")
        for block in completed + ([partial] if partial is not None else []):
            pool += [block["C"], matched(block, "phase"), matched(block, "split")]
            bias += [0.0, bias_phase, bias_split]
        logit_bias = torch.stack([torch.as_tensor(v, dtype=e.dtype) for v in bias])
        routed = route_reference(pool, query=params.site(b, p, "query"),
                                 key_norm_weight=params.site(b, p, "key_norm_weight"),
                                 logit_bias=logit_bias if len(pool) > 1 else None, eps=eps)
        x = stream.site_input(routed, b, p)
        outs = [(kind, fn(norm(x))) for kind, fn in parts]
        u = sum(o for _, o in outs)
        stream.add(u)
        if len(outs) == 1:
            phase = outs[0][1] if outs[0][0] == "attention" else -outs[0][1]
        elif phase_of_parts:
            phase = sum(o if kind == "attention" else -o for kind, o in outs)
        else:
            phase = torch.zeros_like(u)
        position = (index - 1) % block_size + 1
        split = u if position <= half else -u
        if partial is None:
            partial = {"C": u, "phase": phase, "split": split}
        else:
            partial = {"C": partial["C"] + u, "phase": partial["phase"] + phase, "split": partial["split"] + split}
        if position == block_size:
            completed.append(partial)
            partial = None
    pool = [e] + [blk["C"] for blk in completed] + ([partial["C"]] if partial is not None else [])
    routed = route_reference(pool, query=params.readout("query"),
                             key_norm_weight=params.readout("key_norm_weight"), eps=eps)
    return head(gpt, stream.readout_input(routed))


# ------------------------------------------------------------------------------ DAR
#: docs/spec.md section 6: for target stream j, (stream the keys come from, stream the values come from)
DAR_ROLES = {
    "dar": lambda j: (1 - j, j),
    "selfkv": lambda j: (j, j),
    "crossv": lambda j: (j, 1 - j),
    "fixedkv": lambda j: (0, 1),
}


def dar_logits(gpt, params: Params, ids, variant: str = "dar", layers_per_block: int = 1, eps: float = 1e-6,
               record: list | None = None):
    """docs/spec.md section 6. ``record``, if given, receives the two streams' completed entries at the end."""
    e = embed(gpt, ids)
    stream = Stream(e, params)
    history = [[e], [e]]
    partial = None  # [P^0, P^1] once the block has started
    roles = DAR_ROLES[variant]

    def read(get):
        pools = [history[j] + ([partial[j]] if partial is not None else []) for j in (0, 1)]
        q, g = get("query"), get("key_norm_weight")
        r = []
        for j in (0, 1):
            key_from, value_from = roles(j)
            r.append(route_reference(pools[value_from], pools[key_from], query=q[j], key_norm_weight=g[j], eps=eps))
        s = torch.sigmoid(get("mix"))
        return s * r[0] + (1 - s) * r[1]

    per_layer = [len(layers(block, None)) for block in gpt.blocks]
    for b, p, norm, parts in sites(gpt, ids):
        x = stream.site_input(read(lambda f: params.site(b, p, f)), b, p)
        u = sum(fn(norm(x)) for _, fn in parts)
        stream.add(u)
        beta = params.site(b, p, "beta")
        if partial is None:
            partial = [beta[0] * u, beta[1] * u]
        else:
            rho = torch.sigmoid(params.site(b, p, "transport"))
            partial = [rho * partial[0] + (1 - rho) * partial[1] + beta[0] * u,
                       (1 - rho) * partial[0] + rho * partial[1] + beta[1] * u]
        if p == per_layer[b] and (b + 1) % layers_per_block == 0:
            history = [history[0] + [partial[0]], history[1] + [partial[1]]]
            partial = None
    if record is not None:
        record.extend(history)
    return head(gpt, stream.readout_input(read(params.readout)))
