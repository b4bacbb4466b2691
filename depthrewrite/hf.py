"""Saving and loading rewritten Hugging Face models.

``rewrite()`` records its recipe in ``model.config.depthrewrite`` (scheme and options), so
``model.save_pretrained(path)`` stores it in ``config.json`` next to the weights, routing
parameters included. :func:`from_pretrained` loads the original architecture with
transformers' own loader (which also converts checkpoint layouts, e.g. Mixtral's experts),
applies the same rewrite, and loads the routing parameters back.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import json
import logging
import pathlib
import re
from typing import Any

import torch
from torch import nn

from .errors import DepthRewriteError

log = logging.getLogger(__name__)

CONFIG_KEY = "depthrewrite"
ROUTING_KEY_PART = ".depth_route."


def record_recipe(model: nn.Module, scheme: str, options: dict) -> None:
    """Store the rewrite recipe in an HF config, if the model has one. ``options``: every
    option of the scheme as used (``Scheme.resolved_options``: defaults and automatic
    choices filled in), so that a later version with other defaults rebuilds the model as
    it was saved (the same computation, not only the same weights)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        own = _own_config(model, config)
        setattr(own, CONFIG_KEY, {"scheme": scheme, "options": dict(options)})


def _own_config(model: nn.Module, config: Any) -> Any:
    """A copy of ``config`` that only ``model`` holds. Models built from one config object
    share it (transformers keeps the reference), so a recipe written into it would be
    claimed by every one of them: a plain sibling would save a rewrite it does not have, and
    rewriting a sibling with another scheme would change what this model saves (its trained
    routing then dropped on load). Every submodule that held the shared object gets the copy,
    so the model stays consistent with itself."""
    own = copy.deepcopy(config)
    for module in model.modules():
        if getattr(module, "config", None) is config:
            module.config = own
    return own


def recorded_recipe(model: nn.Module) -> dict | None:
    """The rewrite recipe an HF config records (``record_recipe``; saved in config.json), if any."""
    recipe = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return recipe if isinstance(recipe, dict) else None


def _saved_recipe(path: pathlib.Path) -> dict:
    """The recipe in ``path``'s config.json, checked: a local folder (Hub ids are not
    fetched), written by ``save_pretrained`` of a rewritten model."""
    if not (path / "config.json").is_file():
        found = "a file" if path.is_file() else "a folder without config.json" if path.is_dir() else "nothing there"
        raise DepthRewriteError(f"from_pretrained: path must be a local folder written by save_pretrained of a "
                                f"rewritten model (Hub ids are not fetched); found {found} at {str(path)!r}")
    recipe = json.loads((path / "config.json").read_text()).get(CONFIG_KEY)
    if recipe is None:
        raise DepthRewriteError(
            f"from_pretrained: {path / 'config.json'} has no '{CONFIG_KEY}' entry; it was not saved "
            "from a rewritten model (load it with transformers and call depthrewrite.rewrite)"
        )
    if not (isinstance(recipe, dict) and isinstance(recipe.get("scheme"), str)
            and isinstance(recipe.get("options"), dict)):
        raise DepthRewriteError(f"from_pretrained: {path / 'config.json'}'s '{CONFIG_KEY}' entry must be "
                                f"{{'scheme': name, 'options': {{...}}}}, as rewrite records it; found {recipe!r}")
    return recipe


def _routing_tensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DepthRewriteError(f"from_pretrained: no .safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update({k: v for k, v in load_file(str(f)).items() if ROUTING_KEY_PART in k})
    return tensors


def model_from_config(path_or_id: str | pathlib.Path, layers: int | None = None) -> nn.Module:
    """A causal LM built with random weights from a local config: a ``config.json``, a folder
    holding one, or a model id in the local Hugging Face cache (nothing is downloaded).
    ``layers`` shrinks the stack (for inspecting large models cheaply)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = pathlib.Path(path_or_id)
    source = str(path.parent if path.name == "config.json" else path_or_id)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as exc:
        raise DepthRewriteError(f"no local config for {str(path_or_id)!r}: {exc}") from exc
    if layers is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not hasattr(text, "num_hidden_layers"):
            raise DepthRewriteError(f"{type(config).__name__} has no num_hidden_layers to set to {layers}")
        text.num_hidden_layers = layers
    return AutoModelForCausalLM.from_config(config)


#: the logger transformers writes its load report to (``log_state_dict_report``)
_LOAD_REPORT_LOGGER = "transformers.modeling_utils"


#: transformers 4.x's warning of unused checkpoint weights: the list of their keys
_UNUSED_WEIGHTS = re.compile(r"were not used when initializing \S+: (\[[^\]]*\])")


class _RoutingKeyReportFilter(logging.Filter):
    """Drops what transformers' load report says of the routing parameters: the original
    architecture does not have them, and :func:`from_pretrained` loads them right after.
    Any other key (missing, mismatched, other unexpected keys) is kept; a report left with
    none is dropped. A report whose format is not recognised passes unchanged. Two formats:
    transformers 5's table (``LOAD REPORT``), 4.x's "Some weights ... were not used" list."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" in message:
            return self._table(record, message)
        unused = _UNUSED_WEIGHTS.search(message)
        if unused is not None:
            return self._unused_list(record, message, unused)
        return True

    @staticmethod
    def _table(record: logging.LogRecord, message: str) -> bool:
        lines = message.split("\n")
        rows = [ln for ln in lines if "|" in ln and not set(ln) <= set("-+| ")][1:]  # without the header
        routing = [ln for ln in rows if ROUTING_KEY_PART in ln.split("|")[0]]
        if not routing:
            return True
        if len(routing) == len(rows):
            return False
        kept = [ln for ln in lines if ln not in routing]
        if not any("UNEXPECTED" in ln for ln in rows if ln not in routing):
            kept = [ln for ln in kept if "UNEXPECTED:" not in ln]  # its note, now without a row
        record.msg, record.args = "\n".join(kept), ()
        return True

    @staticmethod
    def _unused_list(record: logging.LogRecord, message: str, unused: re.Match) -> bool:
        try:
            keys = ast.literal_eval(unused.group(1))
        except (ValueError, SyntaxError):
            return True
        kept = [k for k in keys if ROUTING_KEY_PART not in str(k)]
        if len(kept) == len(keys):
            return True
        if not kept:
            return False
        record.msg, record.args = message[:unused.start(1)] + repr(kept) + message[unused.end(1):], ()
        return True


@contextlib.contextmanager
def _routing_keys_not_reported():
    logger = logging.getLogger(_LOAD_REPORT_LOGGER)
    report_filter = _RoutingKeyReportFilter()
    logger.addFilter(report_filter)
    try:
        yield
    finally:
        logger.removeFilter(report_filter)


def from_pretrained(path: str | pathlib.Path, auto_class: Any = None, **kwargs) -> nn.Module:
    """Load a model saved with ``save_pretrained`` after a rewrite.

    ``auto_class`` defaults to ``transformers.AutoModelForCausalLM``; ``kwargs`` go to its
    ``from_pretrained`` (``dtype``, ...). The saved recipe is applied again and every
    routing parameter must be found in the checkpoint.
    """
    from .rewrite import rewrite

    path = pathlib.Path(path)
    recipe = _saved_recipe(path)
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class
    with _routing_keys_not_reported():
        model = auto_class.from_pretrained(str(path), **kwargs)
    model = rewrite(model, recipe["scheme"], **recipe["options"])
    routing = _routing_tensors(path)
    expected = {n for n, _ in model.named_parameters() if ROUTING_KEY_PART in n}
    missing = sorted(expected - set(routing))
    if missing:
        raise DepthRewriteError(f"from_pretrained: routing parameters missing from {path}: {missing[:5]}")
    model.load_state_dict(routing, strict=False)
    log.info("loaded %s rewritten with %s", type(model).__name__, recipe["scheme"])
    return model
