"""One source's routing logit in the two-phase merges, with a backward whose sum over the
tokens is a matrix product.

For one source ``v`` of a merge (the partial block's sum, or DAR's partial key), per head
``h`` (the RMS statistic over the full width ``d``)::

    z[t, h] = sum_{c in head h} q[c] g[c] v[t, c] rstd[t],   rstd[t] = (mean_c v[t, c]^2 + eps)^-1/2

The gradient of the pseudo-query ``q`` and the key-norm weight ``g`` is one sum over every
token, ``sum_t dz[t, h(c)] rstd[t] v[t, c]`` times ``g[c]`` or ``q[c]``. Written as plain
torch ops, Inductor makes that sum a kernel of its own: ``dz`` comes from a reduction over
each token's row (the merge weight's gradient), and Inductor fuses a reduction over the
tokens into the pass over the rows only where the two are siblings (its mix-order
reductions). The kernel of its own reads ``v`` again, and with it everything the sums
over the tokens it shares a kernel with read: at Block AttnRes's merges the branch norm's
weight gradient, whose inputs are four activations a site (H100, 350M GPT, session 68:
40 such kernels a step, 2.2 ms; docs/benchmarks.md).

:func:`source_logit` computes the same logit forward (plain torch ops, fused by Inductor
with the merge), and its backward forms the sum over the tokens as a matrix product of the
per-token weights ``dz * rstd`` with ``v`` as stored (bf16), in float32: one read of ``v``,
outside Inductor's reductions, so that the norm's weight gradient becomes a sibling that
Inductor folds into the pass over the rows. The per-token weights are float32; to keep them
so through a bf16 product each goes in as three bf16 parts (its rounding, the rounding of
the rest, and of what is left then: 24 significant bits, where one bf16 has 8), and the
product accumulates in float32 (``torch.mm(..., out_dtype=torch.float32)`` on CUDA; float32
arithmetic on the bf16 values elsewhere, the same numbers).

Used where the source is a bf16 tensor upcast to float32 (the merges of Block AttnRes,
block MHAR, DAR, and full AttnRes's merges of one entry), or that upcast times a per-token
factor that takes no gradient (two-phase WAV's RMS-matched partial details, ``route``'s
``source_scale``: the factor joins the per-token weights); other dtypes keep the plain ops.
``MATMUL_TOKEN_SUM = False`` uses the plain ops everywhere (the form before session 68).

The sum over the tokens itself is the op ``depthrewrite::token_weighted_sum`` where
``TRITON_TOKEN_SUM`` is on: on CUDA a Triton kernel that reads ``stored`` once with the
weights in float32 (:mod:`depthrewrite.kernels.token_sum_triton`); elsewhere, and with the
fused kernels off, the product above. Off by default until timed on a GPU (session 81 wrote
it while no device machine was lent).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["source_logit", "source_logit_reference", "token_weighted_sum", "token_weighted_sum_product",
           "split_into_parts", "MATMUL_TOKEN_SUM", "TRITON_TOKEN_SUM"]

#: the backward's sum over the tokens as a matrix product (see the module docstring); False:
#: the logit as plain torch ops, differentiated by autograd. DAR block's step is 2.2 % shorter
#: with it (H100, session 68); Block AttnRes's was level then, and 1.1 % longer than without
#: it on an H100 at session 80's code (one run; the products run at ~1 TB/s: docs/benchmarks.md,
#: "Session 80")
MATMUL_TOKEN_SUM = True

#: the backward's sum over the tokens through the op ``depthrewrite::token_weighted_sum``
#: (its CUDA kernel: :mod:`depthrewrite.kernels.token_sum_triton`), not the product inline.
#: Off until an end-to-end run on a GPU says which is faster: the kernel's first form (session
#: 81) made Block AttnRes's H100 step 0.9 % shorter than the products in one run, but was
#: slower than Inductor's reduction of the sum; its second (session 82) is not yet timed
TRITON_TOKEN_SUM = False

#: the stored dtypes whose sources take the matrix-product backward: bf16's exponent range is
#: float32's, so no weight of a gradient's size overflows or flushes to zero in its parts, as
#: it could in fp16's range (6e-8 to 65504)
MATMUL_DTYPES = (torch.bfloat16,)

#: bf16 parts a float32 weight is split into for the product: 3 x 8 significant bits hold
#: float32's 24, so the sum is the plain ops' up to the order of the float32 additions
WEIGHT_PARTS = 3


def source_logit_reference(value: Tensor, query: Tensor, key_norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    """``z[..., h] = sum_{c in head h} q[c] RMSNorm_g(value)[c]`` (statistic over the full
    width), in ``value``'s dtype, as plain torch ops: one source's logit, as ``route``
    computes it."""
    dtype = value.dtype
    normed = F.rms_norm(value, (value.shape[-1],), eps=float(eps))
    return (normed * (key_norm_weight.to(dtype) * query.to(dtype))).unflatten(-1, (heads, -1)).sum(-1)


def source_logit(value: Tensor, stored: Tensor | None, query: Tensor, key_norm_weight: Tensor, heads: int,
                 eps: float, scale: Tensor | None = None) -> Tensor:
    """:func:`source_logit_reference` of ``value``, with the sum over the tokens of its
    backward as a matrix product where ``stored`` is bf16 and ``value`` is its float32
    upcast, exactly, or with ``scale`` (float32, ``(*batch,)``, no gradient) that upcast
    times ``scale[..., None]``, exactly; ``stored`` None, another dtype, or a scale that
    needs a gradient (the product gives it none): the reference."""
    if (MATMUL_TOKEN_SUM and stored is not None and stored.dtype in MATMUL_DTYPES
            and value.dtype == torch.float32 and _takes_product(scale, value)):
        return _SourceLogit.apply(value, stored, query, key_norm_weight, heads, float(eps), scale)
    return source_logit_reference(value, query, key_norm_weight, heads, eps)


def _takes_product(scale: Tensor | None, value: Tensor) -> bool:
    return scale is None or (scale.dtype == torch.float32 and not scale.requires_grad
                             and tuple(scale.shape) == tuple(value.shape[:-1]))


def token_weighted_sum(weights: Tensor, stored: Tensor, heads: int) -> Tensor:
    """``out[c] = sum_t weights[t, c // (d / heads)] * stored[t, c]`` in float32, over every
    token ``t`` (all leading dimensions): ``weights`` float32 of shape ``(*batch, heads)``,
    ``stored`` bf16 of shape ``(*batch, d)``. :func:`token_weighted_sum_product`, or with
    :data:`TRITON_TOKEN_SUM` the op ``depthrewrite::token_weighted_sum`` (the same sum; on
    CUDA a Triton kernel)."""
    if TRITON_TOKEN_SUM:
        return torch.ops.depthrewrite.token_weighted_sum(weights, stored, heads)
    return token_weighted_sum_product(weights, stored, heads)


def token_weighted_sum_product(weights: Tensor, stored: Tensor, heads: int) -> Tensor:
    """:func:`token_weighted_sum` as one matrix product reading ``stored`` once, the weights
    as :data:`WEIGHT_PARTS` bf16 parts each, the sums in float32."""
    d, parts = stored.shape[-1], WEIGHT_PARTS
    rows = split_into_parts(weights.reshape(-1, heads), stored.dtype, parts)  # (T, parts * H)
    flat = stored.reshape(-1, d)
    if stored.is_cuda:
        sums = torch.mm(rows.t(), flat, out_dtype=torch.float32)  # (parts * H, d)
    else:  # no such product on the CPU: the same float32 arithmetic on the same bf16 values
        sums = rows.t().float() @ flat.float()
    sums = sums.view(parts, heads, heads, d // heads)
    # head h's columns take head h's weights: the diagonal blocks, the parts added
    return torch.diagonal(sums, dim1=1, dim2=2).sum(0).transpose(0, 1).reshape(d)


@torch.library.custom_op("depthrewrite::token_weighted_sum", mutates_args=())
def _token_weighted_sum_op(weights: Tensor, stored: Tensor, heads: int) -> Tensor:
    """The op's implementation off CUDA (and on CUDA with the fused kernels off): the
    product. Its CUDA kernel is registered by :mod:`depthrewrite.kernels`."""
    return token_weighted_sum_product(weights, stored, heads)


@_token_weighted_sum_op.register_fake
def _(weights: Tensor, stored: Tensor, heads: int) -> Tensor:
    return stored.new_empty((stored.shape[-1],), dtype=torch.float32)


def split_into_parts(weights: Tensor, dtype: torch.dtype, parts: int) -> Tensor:
    """float32 ``weights`` ``(T, H)`` as ``parts`` ``dtype`` parts side by side,
    ``(T, parts * H)``, whose sum is each weight: the rounding, then the rounding of what is
    left, and so on (each subtraction exact in float32)."""
    pieces, rest = [], weights
    for _ in range(parts):
        piece = rest.to(dtype)
        pieces.append(piece)
        rest = rest - piece.float()
    return torch.cat(pieces, dim=1)


class _SourceLogit(torch.autograd.Function):
    """The logit of ``value`` (float32: ``stored`` upcast, times ``scale`` per token if
    given) with a matrix-product backward for the sum over the tokens; ``stored`` and
    ``scale`` get no gradient (``value`` does)."""

    @staticmethod
    def forward(ctx, value, stored, query, key_norm_weight, heads, eps, scale=None):
        rstd = torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + eps)
        qg = key_norm_weight.to(value.dtype) * query.to(value.dtype)
        z = (value * rstd * qg).unflatten(-1, (heads, -1)).sum(-1)
        # the stored tensor, not its float32 upcast: half the bytes, and the upcast is exact
        ctx.save_for_backward(stored, rstd, z, query, key_norm_weight, scale)
        ctx.heads = heads
        return z

    @staticmethod
    def backward(ctx, grad_z):
        stored, rstd, z, query, key_norm_weight, scale = ctx.saved_tensors
        heads = ctx.heads
        # value[t, c] = s[t] stored[t, c]: the token sum's weights take s, the row stays as stored
        column = None if scale is None else scale.unsqueeze(-1)
        factor = rstd if column is None else rstd * column
        grad_value = grad_query = grad_weight = None
        if ctx.needs_input_grad[0]:
            value = stored.to(z.dtype) if column is None else stored.to(z.dtype) * column
            d = value.shape[-1]
            normed = value * rstd
            qg = key_norm_weight.to(z.dtype) * query.to(z.dtype)
            grad_normed = (grad_z.unsqueeze(-1) * qg.unflatten(-1, (heads, -1))).flatten(-2)
            # RMSNorm's backward; sum_c grad_normed[c] normed[c] = sum_h grad_z[h] z[h]
            projection = (grad_z * z).sum(-1, keepdim=True) / d
            grad_value = rstd * (grad_normed - normed * projection)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            grad_qg = token_weighted_sum(grad_z * factor, stored, heads)
            if ctx.needs_input_grad[2]:
                grad_query = (grad_qg * key_norm_weight.to(grad_qg.dtype)).to(query.dtype)
            if ctx.needs_input_grad[3]:
                grad_weight = (grad_qg * query.to(grad_qg.dtype)).to(key_norm_weight.dtype)
        return grad_value, None, grad_query, grad_weight, None, None, None
