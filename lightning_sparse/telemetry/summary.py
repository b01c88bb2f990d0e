"""The end-of-fit compression summary: a table per way of sending and per bucket group, with its title."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import IO, Any

from lightning_sparse._utils import describe_callable, resolve_value_dtype
from lightning_sparse.config import SparseConfig
from lightning_sparse.wire.stats import FLUSH_METHOD, HAND_OVER, Counters, Telemetry

#: the table's columns, after the row name
COLUMNS = ("buckets", "dense wire", "wire bytes", "ratio", "msg ratio", "mean density", "compress s", "% of step")

#: the row names of ways of sending that are not the compressor's name
_METHOD_NAMES = {"local step": "not sent (local steps)", FLUSH_METHOD: "dense (hand-over at the end)"}

#: what :meth:`CompressionSummary.from_telemetry` adds below the table
ADDS_UP = (
    "Each section's rows add up to the total row: buckets, bytes and times are totals over all the steps "
    "summarised, not per step."
)

#: the settings the title names before the others (mode, compressor, density), whatever their values
_TITLE_SETTINGS = ("compress", "compressor", "density")


def format_bytes(n: float) -> str:
    """Decimal byte count with two decimals: ``512 B``, ``11.50 kB``, ``441.35 MB``."""
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("kB", "MB", "GB"):
        n /= 1000.0
        if abs(n) < 1000:
            return f"{n:.2f} {unit}"
    return f"{n / 1000.0:.2f} TB"


def changed_settings(config: SparseConfig) -> dict[str, str]:
    """The settings of ``config`` that differ from their defaults, as text, in declaration order (but the mode,
    compressor and density)."""
    out = {}
    for f in dataclasses.fields(config):
        if not f.init or f.name in _TITLE_SETTINGS:
            continue
        value = getattr(config, f.name)
        # value_dtype is normalised to a torch dtype: compare with the default's
        default = resolve_value_dtype(f.default) if f.name == "value_dtype" else f.default
        if default is dataclasses.MISSING or type(value) is not type(default) or value != default:
            # classes and factories by their import path
            out[f.name] = str(describe_callable(value)) if callable(value) else repr(value)
    return out


def fit_title(config: SparseConfig, steps: int, rank: int, world_size: int) -> str:
    """The summary's header: mode, compressor, density schedule, the :func:`changed_settings`, steps and rank."""
    title = f"Sparse {config.compress} communication: {config.compressor!r}, {config.schedule!r}"
    changed = changed_settings(config)
    if changed:
        title += "; " + ", ".join(f"{name}={value}" for name, value in changed.items())
    return f"{title}; {steps} steps, rank {rank} of {world_size}"


def _ratio(ratio: float, dense: float, sent: float) -> str:
    """A ratio cell; ``-`` where one side is 0 and the other not."""
    return "-" if (dense == 0) != (sent == 0) else f"{ratio:.1f}x"


def _diff(now: dict[str, Counters], start: dict[str, Counters]) -> dict[str, Counters]:
    """The counters accumulated since ``start``, leaving out rows with nothing in them."""
    diffs = {name: c - start[name] if name in start else c.copy() for name, c in now.items()}
    return {name: d for name, d in diffs.items() if any(d.as_dict().values())}


@dataclass
class CompressionSummary:
    """Compression figures of one rank over a span of steps, ready to print; each section (per way of sending, per
    bucket group) adds up to the total.

    Args:
        title: the table's title.
        methods: totals per way buckets were sent (compressor name, ``"dense (warm-up)"``, ...).
        groups: totals per bucket group (the parameters of a bucket, first .. last).
        total: totals over everything.
        step_seconds: wall time of the span's training steps (None: unknown), for % of step.

    Example:
        >>> from lightning_sparse.wire.stats import Counters
        >>> c = Counters(dense_bytes=4_000_000, sent_bytes=100_000, numel=1_000_000, sent_numel=10_000, buckets=4)
        >>> c.wire_bytes, c.dense_wire_bytes = 300_000.0, 6_000_000.0  # 4 ranks
        >>> s = CompressionSummary("example", {"topk": c}, {"fc.weight": c}, c, step_seconds=2.0)
        >>> "6.00 MB" in s.to_text() and "20.0x" in s.to_text() and "40.0x" in s.to_text()
        True
    """

    title: str
    methods: dict[str, Counters]
    groups: dict[str, Counters]
    total: Counters
    step_seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_telemetry(
        cls,
        telemetry: Telemetry,
        start: Telemetry | None = None,
        step_seconds: float | None = None,
        title: str = "Sparse communication",
    ) -> CompressionSummary:
        """The figures accumulated in ``telemetry`` since the snapshot ``start`` (None: all of them)."""
        start = start if start is not None else Telemetry()
        total = telemetry.total - start.total
        notes = []
        if telemetry.wait_seconds or telemetry.peak_step_wire_bytes:
            waited = telemetry.wait_seconds - start.wait_seconds
            notes.append(
                f"The largest step's exchange moved {format_bytes(telemetry.peak_step_wire_bytes)} through this rank; "
                f"waiting for exchanges took {waited:.2f} s."
            )
        methods = _diff(telemetry.methods, start.methods)
        flush = methods.get(FLUSH_METHOD)
        if flush is not None and total.wire_bytes:
            notes.append(
                f"The hand-over of the residuals (one dense all-reduce of what the processes had not sent, the "
                f"row 'dense (hand-over at the end)', not in the largest step) moved {format_bytes(flush.wire_bytes)} "
                f"through this rank, {100.0 * flush.wire_bytes / total.wire_bytes:.0f}% of the wire bytes; dense DDP "
                "needs none, so its dense wire is 0 and the total's ratio counts it against the strategy."
            )
        handed = [c.wire_bytes for name, c in methods.items() if name.endswith(f"({HAND_OVER})")]
        if handed and total.wire_bytes:
            notes.append(
                f"The hand-over in exchanges (flush_at_end=R: the rows '... ({HAND_OVER})', not steps) moved "
                f"{format_bytes(sum(handed))} through this rank, {100.0 * sum(handed) / total.wire_bytes:.0f}% of the "
                "wire bytes; dense DDP needs none, so their dense wire is 0."
            )
        if telemetry.group_bytes is not None:
            inside = telemetry.group_bytes - (start.group_bytes or 0.0)
            notes.append(
                f"Inside this process's group (FSDP2's all-gathers and reduce-scatters, not in the table): "
                f"{format_bytes(inside)} moved through it."
            )
        notes.append(ADDS_UP)
        return cls(title, methods, _diff(telemetry.groups, start.groups), total, step_seconds, notes)

    def _cells(self, c: Counters) -> list[str]:
        share = f"{100.0 * c.compress_seconds / self.step_seconds:.1f}%" if self.step_seconds else "-"
        return [
            str(c.buckets),
            format_bytes(c.dense_wire_bytes),
            format_bytes(c.wire_bytes),
            _ratio(c.compression_ratio, c.dense_wire_bytes, c.wire_bytes),
            _ratio(c.message_ratio, c.dense_bytes, c.sent_bytes),
            f"{c.density:.4f}" if c.numel else "-",
            f"{c.compress_seconds:.3f}",
            share,
        ]

    def sections(self) -> list[tuple[str, list[tuple[str, list[str]]]]]:
        """(heading, [(row name, cells)]) in display order: by compressor, by bucket group, total."""
        by_method = sorted(
            self.methods.items(), key=lambda kv: (-kv[1].wire_bytes, -kv[1].sent_bytes, -kv[1].dense_bytes)
        )
        return [
            ("sent as", [(_METHOD_NAMES.get(name, name), self._cells(c)) for name, c in by_method]),
            ("bucket group", [(name, self._cells(c)) for name, c in self.groups.items()]),
            ("total", [("all buckets", self._cells(self.total))]),
        ]

    def to_text(self) -> str:
        """The table as aligned plain text (no colours, ASCII only)."""
        sections = self.sections()
        names = [name for _, rows in sections for name, _ in rows] + [h for h, _ in sections]
        width0 = max(len(n) for n in names)
        widths = [
            max([len(h)] + [len(cells[i]) for _, rows in sections for _, cells in rows]) for i, h in enumerate(COLUMNS)
        ]
        header = " " * width0 + "".join(f"  {h:>{w}}" for h, w in zip(COLUMNS, widths, strict=True))
        rule = "-" * len(header)
        lines = [self.title, rule, header]
        for heading, rows in sections:
            lines.append(rule)
            if heading != "total":
                lines.append(f"{heading}:")
            for name, cells in rows:
                lines.append(f"{name:<{width0}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells, widths, strict=True)))
        lines.append(rule)
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_rich(self) -> Any:
        """The table as a ``rich.table.Table``."""
        from rich import box
        from rich.table import Table

        sections = self.sections()
        table = Table(
            title=self.title,
            title_justify="left",
            box=box.SIMPLE_HEAD,
            padding=0,  # the box's one-space divider separates the columns: the table fits 80 columns
            collapse_padding=True,
            pad_edge=False,
        )
        # figures never wrap (a narrow terminal folds the long bucket-group names instead)
        table.add_column("", overflow="fold", min_width=16)
        for i, h in enumerate(COLUMNS):
            header = h.rsplit(" ", 1)  # two lines keep the table within 80 columns
            width = max(len(text) for text in [*header, *(c[i] for _, rows in sections for _, c in rows)])
            table.add_column("\n".join(header), justify="right", no_wrap=True, min_width=width)
        for i, (heading, rows) in enumerate(sections):
            if i:
                table.add_section()
            if heading != "total":
                table.add_row(f"[bold]{heading}[/bold]", *[""] * len(COLUMNS))
            for name, cells in rows:
                style = "bold" if heading == "total" else None
                table.add_row(name if heading == "total" else f"  {name}", *cells, style=style)
        if self.notes:
            table.caption = "\n".join(self.notes)
        return table

    def print(self, file: IO[str] | None = None, force_terminal: bool | None = None, width: int | None = None) -> None:
        """Print to ``file`` (default stdout): a rich table on a terminal, plain text otherwise (``force_terminal`` and
        ``width`` go to ``rich.console.Console``)."""
        from rich.console import Console

        file = file if file is not None else sys.stdout
        console = Console(file=file, force_terminal=force_terminal, width=width)
        if console.is_terminal:
            console.print(self.to_rich())
        else:
            file.write(self.to_text() + "\n")
            file.flush()
