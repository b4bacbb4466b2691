"""Exceptions raised by depthrewrite. Each message names the module or argument, what was
expected and what was found, so that a user can act on it without reading the rewriter."""

from __future__ import annotations


class DepthRewriteError(Exception):
    """Base class for every error raised by depthrewrite."""


class CaptureError(DepthRewriteError):
    """The model could not be run or traced to find its residual stream, or the example
    input cannot show what the analysis must see (a sequence of one token)."""


class NotPreNormError(DepthRewriteError):
    """A residual site was found but its shape is not PreNorm (docs/spec.md section 1)."""


class NoResidualStreamError(DepthRewriteError):
    """The model has no stack of blocks that carry a residual stream."""


class AlreadyRewrittenError(DepthRewriteError):
    """The model was already rewritten by depthrewrite."""


class RuntimeOrderError(DepthRewriteError):
    """A rewritten model ran its blocks in an order the rewrite did not see at capture."""


class NotAdditiveStreamError(DepthRewriteError):
    """The model has a residual stream, but its update is not ``h + u`` (docs/spec.md section 1):
    a rescaled stream (``a * h + u``), several parallel streams (hyper-connections), or a
    block that runs more than once per forward (recurrent depth)."""


class UnsupportedStructureError(DepthRewriteError):
    """A PreNorm residual stream was found, but a structure in it is not supported yet;
    the message says which. Unlike the other refusals this is a gap of depthrewrite."""


class SequenceParallelError(DepthRewriteError):
    """A routed module runs under sequence parallelism without its routing declared so by
    ``depthrewrite.tensor_parallel.parallelize_routing(..., sequence_parallel=True)``: each
    rank routes only its share of the tokens, and the routing gradients would miss the other
    ranks' shares (depthrewrite/tensor_parallel.py)."""
