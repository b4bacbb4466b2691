"""Choices read from environment variables when a module is imported (A/B switches of the
benchmarks: ``DEPTHREWRITE_KERNEL_REGISTRATION``, ``DEPTHREWRITE_AUTOGRAD``)."""

from __future__ import annotations

import os

__all__ = ["environment_choice"]


def environment_choice(variable: str, choices: tuple[str, ...], owner: str) -> str:
    """The value of ``variable``: one of ``choices``, the first where it is unset or empty;
    anything else is a ValueError naming ``owner``, the variable and the choices."""
    value = os.environ.get(variable) or choices[0]
    if value not in choices:
        raise ValueError(f"{owner}: {variable} must be one of {choices}; found {value!r}")
    return value
