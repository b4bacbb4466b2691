"""Multi-stream baselines of docs/spec.md section 8: Hyper-Connections and manifold-constrained
Hyper-Connections (mHC).

The depth state is the tuple of the ``n`` streams ``(H_0, ..., H_{n-1})``, each shaped
like the residual stream, all starting as ``e``. A site's branch reads a combination of the
streams, its update is written back into every stream, and the final norm reads a learned
combination of them. The block's own residual adds are left to continue from the branch
input (``replaces_stream``) and are unused: the streams carry the residual.

Conventions (streams stacked on dim -2 as ``Hs`` of shape ``(..., n, d)``):

- read:  ``x = sum_j pre_j H_j``
- write: ``H'_i = sum_j mix_{i,j} H_j + post_i u``   (``mix`` applied on the left)
- readout (our choice): ``y = sum_j r_j H_j`` with learned ``r`` initialised to ``1/n``,
  summed pairwise so that ``n`` equal streams give back exactly the stream when ``n`` is a
  power of two; ``readout='sum'`` is the papers' parameter-free sum of the streams.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..analysis import Site
from .base import Scheme, SchemeOptions, State, check_bool, finite_number

READOUTS = ("learned", "sum")


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim without a weight (the projections that read it
    have their own scale), statistics in float32 at least."""
    xf = _at_least_float32(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``exp(logits)`` onto doubly stochastic matrices (last
    two dims): ``iters`` rounds of row then column normalisation, in float32 at least.
    Subtracting the max first changes nothing in the result and keeps ``exp`` finite."""
    lf = _at_least_float32(logits)
    m = torch.exp(lf - lf.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m.to(logits.dtype)


def pairwise_sum(terms: list[torch.Tensor]) -> torch.Tensor:
    """Sum as a balanced tree: ``(t0 + t1) + (t2 + t3)``; equal terms then add exactly when
    their number is a power of two."""
    while len(terms) > 1:
        paired = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        terms = paired + ([terms[-1]] if len(terms) % 2 else [])
    return terms[0]


def _combine(weights: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j H_j`` for weights ``(..., n)`` (or ``(n,)``) and streams ``(..., n, d)``."""
    return (weights.unsqueeze(-1) * hs).sum(dim=-2)


class StreamReadout(nn.Module):
    """The final norm reads ``sum_j r_j H_j`` (learned ``r``, init ``1/n``) or the plain sum."""

    reads_stream = False
    replaces_stream = True

    def __init__(self, scheme: Scheme, streams: int, learned: bool):
        super().__init__()
        self.weights = scheme.param(streams, fill=1.0 / streams) if learned else None

    def read(self, state: State, h) -> torch.Tensor:
        if self.weights is None:
            return pairwise_sum(list(state))
        return pairwise_sum([w * s for w, s in zip(self.weights, state)])


# --------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True)
class HyperConnOptions(SchemeOptions):
    streams: int = 4  # n, the expansion rate
    dynamic: bool = True  # add the input-dependent (tanh) parts to the static matrices
    readout: str = "learned"  # 'learned' (r init 1/n) or 'sum'
    eps: float = 1e-6  # eps of the RMS normalisation the dynamic parts read


@dataclasses.dataclass(frozen=True)
class MHCOptions(HyperConnOptions):
    sinkhorn_iters: int = 20
    #: initial off-diagonal logit of H_res (diagonal 0). Sinkhorn converges at a rate set by
    #: the matrix's cross-ratio (e^(-2 res_offdiag) for n = 2): at -2, 20 rounds shrink a row
    #: imbalance about 5e4-fold; at -4 only about 4-fold, which left a trained mHC-2's row
    #: sums off by 5e-3 (measured). -2 gives a diagonal of 0.88 (n = 2) or 0.71 (n = 4).
    res_offdiag: float = -2.0
    pre_init: float = 0.9  # initial H_pre weight of the site's own stream; the others share the rest


def _check_options(name: str, opts: HyperConnOptions, min_streams: int) -> None:
    n = opts.streams
    if isinstance(n, bool) or not isinstance(n, int) or n < min_streams:
        raise ValueError(f"{name}: streams must be an integer >= {min_streams}, found {n!r}")
    check_bool(name, "dynamic", opts.dynamic)
    if opts.readout not in READOUTS:
        raise ValueError(f"{name}: readout must be one of {READOUTS}, found {opts.readout!r}")


class _StreamScheme(Scheme):
    min_streams = 1

    def __init__(self, options, stream, dtype, device, hints=None):
        super().__init__(options, stream, dtype, device, hints=hints)
        self.n = options.streams

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        _check_options(cls.name, options, cls.min_streams)

    def init_state(self, e):
        return (e,) * self.n

    def readout_router(self):
        return StreamReadout(self, self.n, learned=self.options.readout == "learned")


class _StreamRouter(nn.Module):
    """A site of a multi-stream scheme: the branch reads ``sum_j pre_j H_j``; the streams
    become ``mix @ H + post u``. Subclasses give ``read_weights`` and ``write_weights``
    (each computed where it is used, so that Sinkhorn runs once per site)."""

    reads_stream = False
    replaces_stream = True

    def read(self, state: State, h) -> torch.Tensor:
        hs = torch.stack(state, dim=-2)
        return _combine(self.read_weights(hs), hs)

    def write(self, state: State, u, x, h) -> State:
        hs = torch.stack(state, dim=-2)
        mix, post = self.write_weights(hs)
        new = mix @ hs + post.unsqueeze(-1) * u.unsqueeze(-2)
        return tuple(new.unbind(dim=-2))


# --------------------------------------------------------------------- Hyper-Connections
class HyperConnRouter(_StreamRouter):
    """One site of Hyper-Connections. Static: ``pre`` (A_m, one-hot on stream
    ``(index - 1) mod n``), ``mix`` (A_r^T, identity), ``post`` (B, ones). Dynamic (zeros
    at init, so the static values are exact there): from the per-stream RMS-normalised
    streams ``N_j``, ``pre_j += s_a tanh(N_j . w_pre)``, ``A_r[j, :] += s_a tanh(N_j W_res)``,
    ``post_j += s_b tanh(N_j . w_post)``, with ``s_a = s_b = 0.01`` at init."""

    def __init__(self, scheme: Scheme, site: Site):
        super().__init__()
        n, d = scheme.n, scheme.d
        self.eps = scheme.options.eps
        self.pre = scheme.param(n, fill=0.0)
        with torch.no_grad():
            self.pre[(site.index - 1) % n] = 1.0
        self.res = nn.Parameter(torch.eye(n, dtype=scheme.dtype, device=scheme.device))  # A_r
        self.post = scheme.param(n, fill=1.0)
        self.dynamic = scheme.options.dynamic
        if self.dynamic:
            self.dynamic_pre_res = scheme.param(d, n + 1, fill=0.0)  # W_alpha of the paper
            self.dynamic_post = scheme.param(d, fill=0.0)  # W_beta
            self.scale_pre_res = scheme.param(1, fill=0.01)  # s_alpha
            self.scale_post = scheme.param(1, fill=0.01)  # s_beta

    def read_weights(self, hs: torch.Tensor) -> torch.Tensor:
        """``pre`` (``(n,)``, or ``(..., n)`` when dynamic) for streams ``(..., n, d)``."""
        if not self.dynamic:
            return self.pre
        alpha = torch.tanh(rms_normalize(hs, self.eps) @ self.dynamic_pre_res[:, 0])  # (..., n)
        return self.pre + self.scale_pre_res * alpha

    def write_weights(self, hs: torch.Tensor):
        """``(mix (..., n, n), post (..., n))``; ``mix[i, j]`` is the weight of stream ``j`` in
        the new stream ``i`` (``A_r`` transposed)."""
        if not self.dynamic:
            return self.res.transpose(-1, -2), self.post
        normed = rms_normalize(hs, self.eps)
        alpha = torch.tanh(normed @ self.dynamic_pre_res[:, 1:])  # (..., n, n), row j from stream j
        res = self.res + self.scale_pre_res * alpha
        post = self.post + self.scale_post * torch.tanh(normed @ self.dynamic_post)
        return res.transpose(-1, -2), post


class HyperConnScheme(_StreamScheme):
    """``hyperconn`` (Zhu et al. 2024): ``n`` residual streams; the branch of site ``l``
    reads ``x = A_m^T H``, and the streams become ``H' = A_r^T H + B^T u``. Initialised to
    mimic PreNorm: streams start as copies of ``e``, ``A_m`` one-hot, ``A_r = I``, ``B = 1``
    and the dynamic weights 0, so every stream equals the original residual stream bit for
    bit at every site, each branch reads exactly the original input, and (learned readout,
    ``n`` a power of two) the logits equal the original's bit for bit.
    Options: ``streams`` (4), ``dynamic`` (True), ``readout`` ('learned' or 'sum'), ``eps``.
    New parameters: ``L (n^2 + 2n)`` static, plus ``L (d (n + 2) + 2)`` dynamic, plus ``n``
    for the learned readout."""

    name = "hyperconn"
    Options = HyperConnOptions

    def site_router(self, site: Site):
        return HyperConnRouter(self, site)


# --------------------------------------------------------------------- mHC
class MHCRouter(_StreamRouter):
    """One site of mHC. Coefficients from static logits plus ``alpha * (N phi)``, with
    ``N`` the RMS-normalised flattened streams (width ``n d``, no weight; our choice) and
    ``phi`` zeros at init (alphas 0.01): ``H_pre = sigmoid``, ``H_post = 2 sigmoid``,
    ``H_res = sinkhorn(.)``. Static init (our choice): ``H_pre`` is ``pre_init`` (0.9) on
    stream ``(index - 1) mod n`` and ``(1 - pre_init) / (n - 1)`` on each other stream (sum
    1, and the stream symmetry is broken as by HC's one-hot ``A_m``), ``H_post = 1``,
    ``H_res`` logits 0 on the diagonal and ``res_offdiag`` elsewhere (a doubly stochastic
    matrix near the identity)."""

    def __init__(self, scheme: Scheme, site: Site):
        super().__init__()
        n, d, opts = scheme.n, scheme.d, scheme.options
        self.n, self.eps, self.iters = n, opts.eps, opts.sinkhorn_iters
        # weights summing to 1 (equal streams are read back exactly, up to rounding), the
        # largest on a stream that rotates with the site: with all streams weighted alike
        # every gradient would be symmetric too and the n streams would stay copies forever
        own, rest = opts.pre_init, (1.0 - opts.pre_init) / (n - 1)
        self.pre = scheme.param(n, fill=math.log(rest / (1.0 - rest)))
        with torch.no_grad():
            self.pre[(site.index - 1) % n] = math.log(own / (1.0 - own))
        self.post = scheme.param(n, fill=0.0)  # 2 sigmoid(0) = 1
        res = torch.full((n, n), float(opts.res_offdiag), dtype=scheme.dtype, device=scheme.device)
        self.res = nn.Parameter(res.fill_diagonal_(0.0))
        self.dynamic = opts.dynamic
        if self.dynamic:
            self.phi = scheme.param(n * d, 2 * n + n * n, fill=0.0)
            self.alpha_pre = scheme.param(1, fill=0.01)
            self.alpha_post = scheme.param(1, fill=0.01)
            self.alpha_res = scheme.param(1, fill=0.01)

    def _dynamic(self, hs: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Columns ``start:stop`` of ``RMSNorm(flatten(H)) @ phi``."""
        return rms_normalize(hs.flatten(-2), self.eps) @ self.phi[:, start:stop]

    def read_weights(self, hs: torch.Tensor) -> torch.Tensor:
        """``H_pre``: ``(n,)``, or ``(..., n)`` when dynamic."""
        pre = self.pre
        if self.dynamic:
            pre = pre + self.alpha_pre * self._dynamic(hs, 0, self.n)
        return torch.sigmoid(pre)

    def write_weights(self, hs: torch.Tensor):
        """``(H_res (..., n, n), H_post (..., n))``; the new stream ``i`` is
        ``sum_j H_res[i, j] H_j + H_post[i] u``."""
        n, post, res = self.n, self.post, self.res
        if self.dynamic:
            dyn = self._dynamic(hs, n, 2 * n + n * n)
            post = post + self.alpha_post * dyn[..., :n]
            res = res + self.alpha_res * dyn[..., n:].unflatten(-1, (n, n))
        return sinkhorn(res, self.iters), 2.0 * torch.sigmoid(post)


class MHCScheme(_StreamScheme):
    """``mhc`` (manifold-constrained Hyper-Connections; ``streams=2`` is mHC-2):
    ``x_{l+1} = H_res x_l + H_post^T f(H_pre x_l)`` with ``H_res`` doubly stochastic
    (Sinkhorn-Knopp, ``sinkhorn_iters`` rounds, default 20). Streams start as copies of
    ``e``; since a doubly stochastic ``H_res`` keeps equal streams equal, the model starts
    close to the original (up to rounding). Sinkhorn converges at a rate set by the spread
    of the logits: 20 rounds give row sums within 1e-3 for trained tiny models, but logits
    spread over +-2 or more can need ~100, and a 2 x 2 whose log cross ratio
    ``l00 + l11 - l01 - l10`` is 10.7 needs 300-500 to bring its rows within 1e-3 to 1e-6
    (raise ``sinkhorn_iters``). Options: ``streams``
    (4, at least 2), ``dynamic`` (True), ``sinkhorn_iters`` (20), ``res_offdiag`` (-2.0),
    ``pre_init`` (0.9), ``readout`` ('learned' or 'sum'), ``eps``. New parameters:
    ``L (n^2 + 2n)`` static, plus ``L (n d (n^2 + 2n) + 3)`` dynamic, plus ``n`` for the
    learned readout."""

    name = "mhc"
    Options = MHCOptions
    min_streams = 2  # the other streams share 1 - pre_init of H_pre at init

    @classmethod
    def check_options(cls, options) -> None:
        super().check_options(options)
        iters = options.sinkhorn_iters
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"mhc: sinkhorn_iters must be a positive integer, found {iters!r}")
        finite_number("mhc", "res_offdiag", options.res_offdiag)
        own = options.pre_init
        if isinstance(own, bool) or not isinstance(own, (int, float)) or not 0.0 < own < 1.0:
            raise ValueError(f"mhc: pre_init must be a number strictly between 0 and 1, found {own!r}")

    def site_router(self, site: Site):
        return MHCRouter(self, site)


__all__ = ["HyperConnScheme", "MHCScheme", "sinkhorn", "pairwise_sum"]
