"""depthrewrite: rewrite the PreNorm residual stream of a decoder-only transformer into
depth-routing graphs (Attention Residuals, MHAR, WAV, DAR and their baselines).

    model = depthrewrite.rewrite(model, scheme="attnres")
    print(depthrewrite.inspect(model))
"""

from .analysis import ResidualStream, Site
from .errors import (
    AlreadyRewrittenError, CaptureError, DepthRewriteError, NoResidualStreamError, NotAdditiveStreamError,
    NotPreNormError, RuntimeOrderError, SequenceParallelError, UnsupportedStructureError,
)
from .passes import SCHEMES
from .hf import from_pretrained
from .meta import reset_routing_parameters
from .rewrite import inspect, rewrite
from .added_parameters import named_routing_parameters, routing_parameters
from .routing_weights import RoutingWeights, has_routing_weights, record_routing_weights

__version__ = "0.1.0"

__all__ = [
    "rewrite", "inspect", "from_pretrained", "reset_routing_parameters", "SCHEMES", "ResidualStream", "Site",
    "routing_parameters", "named_routing_parameters", "record_routing_weights", "has_routing_weights",
    "RoutingWeights",
    "DepthRewriteError", "CaptureError", "NotPreNormError", "NoResidualStreamError",
    "AlreadyRewrittenError", "RuntimeOrderError", "NotAdditiveStreamError", "UnsupportedStructureError",
    "SequenceParallelError",
]
