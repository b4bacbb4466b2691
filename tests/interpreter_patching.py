"""Triton's interpreter (``TRITON_INTERPRET=1``, the kernel tests on a machine without a GPU)
without its repeated patching of ``triton.language`` inside a launch.

A launch (``GridExecutor.__call__``) patches the language modules its kernel sees, runs the
programs and restores them. But every call of a ``@triton.jit`` helper from inside the kernel
(``InterpretedFunction.__call__``) patches them again: ``_patch_lang`` walks the modules with
``inspect.getmembers`` and replaces every builtin that is not replaced yet. Inside a launch
there is none left once the modules the helper sees have been patched, so the walk changes
nothing, yet it cost the kernel tests most of their time: our kernels call helpers per
source and per token block. Measured on the 2-core CI VM (Triton 3.9.0, 2026-12-03, the
whole suite with ``-n 2 --durations=0``): ``tests/kernels`` took 367 s of the two workers'
time with the wrapper against 1094 s without; one test at 65 sources 6.0 s against 11.8.

:func:`install` wraps ``_patch_lang`` so that a helper's call skips the walk when the modules
it sees are already patched in the launch in progress (by the launch, or by an earlier
helper: Triton never restores a helper's patches). Everything else, the launch's own
patching and its restore included, is Triton's; a helper that sees a module the launch did
not patch still patches it as before. If this Triton's interpreter is not built the way
this wrapper expects, :func:`install` leaves it alone and says so in the log.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

log = logging.getLogger(__name__)

#: the names of the interpreter's parts the wrapper relies on
_EXPECTED = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")

#: helper calls whose walk was skipped since :func:`install` (tests assert it is used)
skipped = 0


_languages_seen: dict[tuple[int, int], frozenset[int]] = {}


def _languages(fn, tl) -> frozenset[int]:
    """The ids of the language modules ``fn`` sees, as ``_patch_lang`` finds them (kept per
    module namespace and its size: a namespace that gains a name is looked at again)."""
    namespace = fn.__globals__
    key = (id(namespace), len(namespace))
    found = _languages_seen.get(key)
    if found is None:
        found = _languages_seen[key] = frozenset(
            id(value) for value in namespace.values() if inspect.ismodule(value) and value in (tl, tl.core))
    return found


def install() -> bool:
    """Wrap the interpreter's launches and ``_patch_lang`` (module docstring). Returns whether
    it did."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter._patch_lang, "_skips_repeats", False):
        return True
    if not all(hasattr(interpreter, name) for name in _EXPECTED):
        log.warning("Triton's interpreter lacks one of %s: its repeated patching is left as it is", _EXPECTED)
        return False
    original_patch, original_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches: list[set[int]] = []  # per launch in progress, the ids of the modules patched in it so far

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        global skipped
        languages = _languages(fn, tl)
        if launches and languages <= launches[-1]:
            skipped += 1
            return interpreter._LangPatchScope()  # nothing to restore: a helper's call drops its scope
        scope = original_patch(fn)
        if launches:
            # patched until the launch ends: its own patches are restored then, a helper's
            # never (Triton drops a helper's scope)
            launches[-1].update(languages)
        return scope

    patch_lang._skips_repeats = True
    patch_lang.originals = (original_patch, original_launch)
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    return True


@contextlib.contextmanager
def uninstalled():
    """Triton's own ``_patch_lang`` and launch for the duration (for the test that compares
    the two); a no-op where :func:`install` did not wrap them."""
    from triton.runtime import interpreter

    wrapped = interpreter._patch_lang
    originals = getattr(wrapped, "originals", None)
    if originals is None:
        yield
        return
    launch = interpreter.GridExecutor.__call__
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = originals
    try:
        yield
    finally:
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = wrapped, launch
