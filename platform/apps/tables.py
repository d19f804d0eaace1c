"""The summary tables the commands print when they end (``fedray run``, ``compare``, ``sweep``)."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table


def summary_table(rows: list[dict[str, Any]], title: str = "fedray") -> Table:
    """rows: algorithm, personal mean/std, global, MB up/down, wall time (and anything else present)."""
    table = Table(title=title)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for col in columns:
        table.add_column(col, justify="left" if col in ("algorithm", "run id") else "right")
    for row in rows:
        table.add_row(*[_cell(row.get(col)) for col in columns])
    return table


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def print_table(table: Table) -> None:
    Console(file=sys.stdout, width=160).print(table)
