"""Outer steps: what the global parameters do with the average of what the ranks sent.

In update mode every exchange ends in one place: :meth:`OuterStep.apply` receives the
:class:`~lightning_sparse.wire.Average` of what the ranks sent for one group of parameters and the
flat global values of those parameters. :class:`AddAverage` (the default) adds the average in;
an outer optimizer (a momentum step on the average, a scaled or decayed step) is another
:class:`OuterStep`, and needs nothing changed in the wire code.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_sparse.wire import Average


class OuterStep:
    """How an exchange's average is applied to the global parameters (update mode).

    Subclasses implement :meth:`apply`; one with state (a momentum buffer) also implements
    :meth:`state_dict` / :meth:`load_state_dict`, which checkpoints carry. The same step runs on
    every rank with the same average, so the global parameters stay identical on every rank.

    Example:
        >>> import torch
        >>> class Halved(OuterStep):
        ...     def apply(self, average, target, names):
        ...         step = average.add_to(torch.zeros_like(target))
        ...         target.add_(step, alpha=0.5)
        >>> isinstance(Halved(), OuterStep)
        True
    """

    def apply(self, average: Average, target: Tensor, names: tuple[str, ...]) -> None:
        """Apply ``average`` (laid out like ``target``) to ``target``, the flat global values of
        the parameters ``names`` (in that order), in place."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The step's state (empty when it has none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore what :meth:`state_dict` returned."""


class AddAverage(OuterStep):
    """Add the average into the global parameters, touching only the coordinates that were sent.

    Example:
        >>> AddAverage().state_dict()
        {}
    """

    def apply(self, average: Average, target: Tensor, names: tuple[str, ...]) -> None:
        average.add_to(target)
