"""A block's rewritten program as Python source, so that a rewritten model pickles
(``torch.save(model)``, ``torch.multiprocessing``'s spawn) with the programs it runs.

A program's code is a function that ``torch.fx`` generated from the rewritten graph; pickle
cannot refer to it by name. It is stored as its source and the imports of the names it
reads, as ``fx.GraphModule`` stores its own code, and made again by executing them when
the model loads. Unlike ``GraphModule``'s load, nothing is traced again: the function is
the same code, run with the block as ``self``.
"""

from __future__ import annotations

from torch.fx.graph_module import _format_import_block, _forward_from_src
from torch.package import sys_importer
from torch.package.importer import ObjNotFoundError

from ..errors import DepthRewriteError


def imports_of(code, block_path: str) -> str:
    """The import statements of the names ``code`` (a function fx generated) reads from its
    globals. Raises a DepthRewriteError naming the block and the object where one of them
    cannot be imported."""
    imports = set()
    for name, obj in code.__globals__.items():
        if name == "__builtins__":
            continue
        try:
            imports.add(_format_import_block({name: obj}, sys_importer))
        except ObjNotFoundError as exc:
            what = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
            raise DepthRewriteError(
                f"block {block_path!r} cannot be pickled: its rewritten code calls {what}, which cannot be "
                "imported by name; save the weights instead (model.state_dict(), or save_pretrained) and "
                "rewrite the loaded model the same way"
            ) from exc
    return "\n".join(sorted(imports))


def function_from_source(imports: str, source: str):
    """The ``forward`` function that ``source`` (fx's text of it) defines, its names
    imported by ``imports`` (:func:`imports_of`)."""
    return _forward_from_src(imports + "\n" + source, {})
