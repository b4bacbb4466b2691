"""Training validation: train the bundled models, plain and rewritten, on byte-level text
and compare schemes (``depthrewrite train`` / ``depthrewrite compare``); a trained run's model
back, and text from it (``depthrewrite sample``)."""

from .data import DataConfig, Splits, batch_at, load_documents, load_splits, split_documents
from .loop import TrainConfig, TrainingInterrupted, TrainResult, evaluate, train
from .metrics import RunHistory, read_history, read_metrics
from .compare import CompareConfig, CompareResult, compare, default_compare_train_config
from .routing_log import read_routing
from .sampling import generate
from .trained_model import TrainedModel, load_trained
from ..routing_weights import RoutingWeights, record_routing_weights

__all__ = [
    "TrainConfig", "TrainResult", "TrainingInterrupted", "train", "evaluate", "read_metrics", "read_history",
    "RunHistory",
    "CompareConfig", "CompareResult", "compare", "default_compare_train_config",
    "RoutingWeights", "record_routing_weights", "read_routing", "TrainedModel", "load_trained", "generate",
    "DataConfig", "Splits", "load_documents", "load_splits", "split_documents", "batch_at",
]
