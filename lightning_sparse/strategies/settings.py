"""The settings as the front ends' flat arguments, declared once in :class:`~lightning_sparse.config.SparseConfig`.

Every front end (Trainer and Fabric; DDP and FSDP2) takes the settings as flat keyword arguments,
``SparseDDPStrategy(density=0.001, sync_every=4)``, which is what the Lightning CLI shows and reads
(``--trainer.strategy.density``). Their names, types, defaults and docs live in the config alone:
:func:`with_settings` writes them into a front end's signature (``__signature__``, which
:func:`inspect.signature` and jsonargparse read) and into its docstring's ``Args:``, with the
arguments it passes on to the Lightning strategy it extends (read from that strategy's signature),
and :func:`take_settings` splits the keyword arguments a front end was given into the config, those
arguments and the rest.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from lightning_sparse.config import SparseConfig

__all__ = ["DDP_ONLY", "setting_default", "take_settings", "with_settings"]

#: the settings that are DDP's own, which the FSDP2 front ends do not take
DDP_ONLY = frozenset({"find_unused_parameters", "static_graph", "gradient_as_bucket_view", "start_method"})
#: where a front end's docstring lists the settings, in its ``Args:``
PLACEHOLDER = "{settings}"

T = TypeVar("T", bound=type)


def _fields(exclude: Iterable[str]) -> list[dataclasses.Field]:
    skip = set(exclude)
    return [f for f in dataclasses.fields(SparseConfig) if f.init and f.name not in skip]


def setting_default(settings: dict[str, Any], name: str) -> Any:
    """The value of setting ``name`` among a front end's keyword arguments, or its default.

    Example:
        >>> setting_default({"density": 0.1}, "density"), setting_default({}, "compress")
        (0.1, 'update')
    """
    return settings[name] if name in settings else SparseConfig.__dataclass_fields__[name].default


def take_settings(cls: type, settings: dict[str, Any]) -> tuple[SparseConfig, dict[str, Any], dict[str, Any]]:
    """A front end's keyword arguments (``cls`` decorated with :func:`with_settings`) split into the
    config of its settings, the arguments it passes on to the Lightning strategy it extends, and the
    rest, which only a front end with ``extra`` takes (for it to check: DDP's own arguments); without
    ``extra``, a name that is none of these raises TypeError naming it.

    Example:
        >>> @with_settings(extra="kwargs")
        ... class Front:
        ...     '''A front end.
        ...
        ...     Args:
        ...         {settings}
        ...     '''
        ...     def __init__(self, **settings: Any) -> None:
        ...         pass
        >>> config, base, rest = take_settings(Front, {"density": 0.1, "broadcast_buffers": False})
        >>> config.density.density(0), base, rest
        (0.1, {}, {'broadcast_buffers': False})
    """
    exclude, inherited, extra = cls._settings  # type: ignore[attr-defined]
    names = {f.name for f in _fields(exclude)}
    base = {k: v for k, v in settings.items() if k in inherited}
    rest = {k: v for k, v in settings.items() if k not in names and k not in inherited}
    if rest and not extra:
        name = next(iter(rest))
        raise TypeError(
            f"{cls.__name__} got an unexpected keyword argument {name!r}: expected one of its own arguments or a "
            f"setting ({', '.join(sorted(names))})."
        )
    return SparseConfig(**{k: v for k, v in settings.items() if k in names}), base, rest


def _entry(name: str, text: str, indent: str) -> str:
    return textwrap.fill(
        f"{name}: {' '.join(text.split())}",
        width=112,
        initial_indent=indent,
        subsequent_indent=indent + "    ",
        break_on_hyphens=False,
        break_long_words=False,
    )


def with_settings(
    exclude: Iterable[str] = (),
    docs: dict[str, str] | None = None,
    extra: str | None = None,
    inherit: tuple[type, Iterable[str]] | None = None,
) -> Callable[[T], T]:
    """Class decorator: the settings of :class:`~lightning_sparse.config.SparseConfig` (but ``exclude``)
    join a front end's own arguments in its signature and its docs.

    The front end's ``__init__`` takes its own arguments and ``**settings`` (it builds the config with
    :func:`take_settings`); its docstring's ``Args:`` holds a line ``{settings}`` where the settings'
    entries go (``docs``: a front end's own words for a setting). The signature lists its own positional
    arguments, then every setting (keyword-only, typed, with its default), then its own keyword-only
    arguments, then ``inherit``'s: the arguments ``(base, names)`` of the Lightning strategy it extends
    that it passes on (their types and defaults read from ``base.__init__``, documented as "as in"
    it), then ``**extra`` where the front end passes further arguments on (DDP's).

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
        init = cls.__init__  # type: ignore[misc]
        hints = typing.get_type_hints(init)
        config_hints = typing.get_type_hints(SparseConfig)
        fields = _fields(exclude)
        own = list(inspect.signature(init).parameters.values())
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own]
        kinds = inspect.Parameter
        leading = [p for p in own if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        trailing = [p for p in own if p.kind is kinds.KEYWORD_ONLY]
        params = [
            *leading,
            *(kinds(f.name, kinds.KEYWORD_ONLY, default=f.default, annotation=config_hints[f.name]) for f in fields),
            *trailing,
        ]
        base, inherited = (inherit[0], tuple(inherit[1])) if inherit is not None else (object, ())
        if inherited:
            base_init = base.__init__  # type: ignore[misc]
            # only these names' types: the others may name what the base imports for type checking alone
            only = types.SimpleNamespace(__annotations__={n: base_init.__annotations__[n] for n in inherited})
            base_hints = typing.get_type_hints(only, globalns=base_init.__globals__)
            defaults = inspect.signature(base_init).parameters
            params += [
                kinds(n, kinds.KEYWORD_ONLY, default=defaults[n].default, annotation=base_hints[n]) for n in inherited
            ]
        if extra is not None:
            params.append(kinds(extra, kinds.VAR_KEYWORD, annotation=Any))
        init.__signature__ = inspect.Signature(params, return_annotation=None)
        # what jsonargparse reads besides the signature: the settings' and the inherited arguments' types
        init.__annotations__ = {**init.__annotations__, **{p.name: p.annotation for p in params if p.name not in hints}}
        cls._settings = (frozenset(exclude), frozenset(inherited), extra is not None)  # type: ignore[attr-defined]
        doc = cls.__doc__ or ""
        line = next((ln for ln in doc.splitlines() if ln.strip() == PLACEHOLDER), None)
        if line is None:
            raise TypeError(f"{cls.__name__}'s docstring needs a line {PLACEHOLDER} in its Args")
        indent = line[: len(line) - len(line.lstrip())]
        words = {**{f.name: f.metadata["doc"] for f in fields}, **(docs or {})}
        origin = "Fabric" if base.__module__.startswith("lightning.fabric") else "Lightning"
        words.update({n: f"as in {origin}'s ``{base.__name__}``." for n in inherited})
        entries = "\n".join(_entry(n, words[n], indent) for n in [*(f.name for f in fields), *inherited])
        cls.__doc__ = doc.replace(line, entries, 1)
        return cls

    return decorate
