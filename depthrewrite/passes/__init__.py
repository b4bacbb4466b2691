"""Rewrite passes: one scheme family a module, all reading the same analysis result; the
two-phase computation several of them share is in :mod:`.two_phase`."""

from __future__ import annotations

import dataclasses

from .attnres import AttnResScheme, BlockAttnResScheme, ResidualScheme
from .base import Scheme, SchemeOptions, check_bool, finite_number
from .baselines import DenseFormerScheme, LayerScaleScheme, ReZeroScheme
from .hyperconn import HyperConnScheme, MHCScheme
from .dar import DarScheme
from .mhar import MharScheme
from .wav import WavScheme

#: every scheme ``depthrewrite.rewrite`` accepts, by name
SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls for cls in (ResidualScheme, AttnResScheme, BlockAttnResScheme,
                     DenseFormerScheme, ReZeroScheme, LayerScaleScheme, HyperConnScheme, MHCScheme,
                     MharScheme, WavScheme, DarScheme)
}


def scheme_class(name: str) -> type[Scheme]:
    if not isinstance(name, str) or name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; valid schemes: {', '.join(sorted(SCHEMES))}")
    return SCHEMES[name]


def scheme_options(cls: type[Scheme], options: dict) -> SchemeOptions:
    """Build the scheme's options dataclass; unknown names are a ValueError listing the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(
            f"scheme {cls.name!r} has no option {', '.join(map(repr, unknown))}; valid options: "
            f"{', '.join(sorted(fields))}"
        )
    opts = cls.Options(**options)
    _check_types(cls.name, opts)
    cls.check_options(opts)
    return opts


def _check_types(scheme: str, opts: SchemeOptions) -> None:
    check_bool(scheme, "preserve_identity", opts.preserve_identity)
    if opts.gate not in ("scalar", "channel"):
        raise ValueError(f"{scheme}: gate must be 'scalar' or 'channel', found {opts.gate!r}")
    if hasattr(opts, "eps"):
        finite_number(scheme, "eps", opts.eps, positive=True)


__all__ = ["SCHEMES", "Scheme", "SchemeOptions", "scheme_class", "scheme_options"]
