"""The settings as the front ends' flat keyword arguments (signature, ``Args:``), declared once in ``SparseConfig``."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Iterable
from typing import Any, TypeVar

from lightning_sparse.config import SparseConfig

__all__ = ["DDP_ONLY", "take_settings", "with_settings"]

#: the settings that are DDP's own, which the FSDP2 front ends do not take
DDP_ONLY = frozenset({"find_unused_parameters", "static_graph", "gradient_as_bucket_view", "start_method"})

T = TypeVar("T", bound=type)


def _fields(exclude: Collection[str]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(SparseConfig) if f.init and f.name not in exclude]


def take_settings(cls: type, settings: dict[str, Any]) -> tuple[SparseConfig, dict[str, Any], dict[str, Any]]:
    """A front end's keyword arguments split into the config, the arguments of the Lightning strategy it extends,
    and the rest (only with ``extra``, else TypeError)."""
    exclude, inherited, extra = cls._settings  # type: ignore[attr-defined]
    names = {f.name for f in _fields(exclude)}
    rest = {k: v for k, v in settings.items() if k not in names and k not in inherited}
    if rest and not extra:
        raise TypeError(
            f"{cls.__name__} got an unexpected keyword argument {next(iter(rest))!r}: expected one of its own "
            f"arguments or a setting ({', '.join(sorted(names))})."
        )
    base = {k: v for k, v in settings.items() if k in inherited}
    return SparseConfig(**{k: v for k, v in settings.items() if k in names}), base, rest


def with_settings(
    exclude: Collection[str] = (),
    docs: dict[str, str] | None = None,
    extra: str | None = None,
    inherit: tuple[type, Iterable[str]] | None = None,
) -> Callable[[T], T]:
    """Class decorator: the settings of :class:`~lightning_sparse.config.SparseConfig` (but ``exclude``) join a
    front end's own arguments in its signature and its docstring's ``Args:`` (at a line ``{settings}``), after its
    positional ones; then its keyword-only ones, ``inherit = (base, names)``'s, and ``**extra``. ``docs``: a front
    end's own words for a setting.

    Example:
        >>> @with_settings(exclude=DDP_ONLY)
        ... class Front:
        ...     '''A front end.
        ...
        ...     Args:
        ...         {settings}
        ...         name: its own.
        ...     '''
        ...     def __init__(self, *, name: str = "x", **settings: Any) -> None:
        ...         self.config, _, _ = take_settings(Front, settings)
        >>> list(inspect.signature(Front).parameters)[:3], Front(density=0.5).config.density.density(0)
        (['compress', 'compressor', 'density'], 0.5)
    """

    def decorate(cls: T) -> T:
        init, Param = cls.__init__, inspect.Parameter  # type: ignore[misc]
        hints, config_hints = typing.get_type_hints(init), typing.get_type_hints(SparseConfig)
        fields = _fields(exclude)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation)) for p in inspect.signature(init).parameters.values()
        ]
        params = [p for p in own if p.kind in (Param.POSITIONAL_ONLY, Param.POSITIONAL_OR_KEYWORD)]
        params += [
            Param(f.name, Param.KEYWORD_ONLY, default=f.default, annotation=config_hints[f.name]) for f in fields
        ]
        params += [p for p in own if p.kind is Param.KEYWORD_ONLY]
        base, inherited = (inherit[0], tuple(inherit[1])) if inherit is not None else (object, ())
        if inherited:
            base_init = base.__init__  # type: ignore[misc]
            # only these names' types: the others may name what the base imports for type checking alone
            only = types.SimpleNamespace(__annotations__={n: base_init.__annotations__[n] for n in inherited})
            base_hints = typing.get_type_hints(only, globalns=base_init.__globals__)
            defaults = inspect.signature(base_init).parameters
            params += [
                Param(n, Param.KEYWORD_ONLY, default=defaults[n].default, annotation=base_hints[n]) for n in inherited
            ]
        if extra is not None:
            params.append(Param(extra, Param.VAR_KEYWORD, annotation=Any))
        init.__signature__ = inspect.Signature(params, return_annotation=None)
        # jsonargparse reads the annotations too
        init.__annotations__ = {**init.__annotations__, **{p.name: p.annotation for p in params if p.name not in hints}}
        cls._settings = (frozenset(exclude), frozenset(inherited), extra is not None)  # type: ignore[attr-defined]
        doc = cls.__doc__ or ""
        line = next((ln for ln in doc.splitlines() if ln.strip() == "{settings}"), None)
        if line is None:
            raise TypeError(f"{cls.__name__}'s docstring needs a line {{settings}} in its Args")
        indent = line[: len(line) - len(line.lstrip())]
        words = {**{f.name: f.metadata["doc"] for f in fields}, **(docs or {})}
        origin = "Fabric" if base.__module__.startswith("lightning.fabric") else "Lightning"
        words.update({n: f"as in {origin}'s ``{base.__name__}``." for n in inherited})
        fill = textwrap.TextWrapper(112, indent, indent + "    ", break_long_words=False, break_on_hyphens=False).fill
        entries = "\n".join(fill(f"{n}: {' '.join(words[n].split())}") for n in [*(f.name for f in fields), *inherited])
        cls.__doc__ = doc.replace(line, entries, 1)
        return cls

    return decorate
