"""Tables that read at the terminal's width: headers and names whole, the least useful columns left out first.

    columns = [Column("device"), Column("vendor", drop=1), Column("$/h", justify="right")]
    print_fitted(console, columns, rows, title="devices and prices")

Rich squeezes a table wider than the terminal by cutting every cell ("H100-…", "TFLO…"), which leaves
nothing readable. Here no cell is cut: columns marked `drop` are left out, lowest `drop` first, until
the rest fits, and a line under the table names what was left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    justify: Literal["left", "right", "center"] = "left"
    drop: int = 0
    """0: always shown; otherwise the order in which columns are left out when the table is too wide (1 first)."""


def fitted_table(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]],
                 **table_options) -> tuple[Table, list[str]]:
    """The widest table of whole cells that fits `console.width`, and the headers of the columns left out."""
    kept = list(range(len(columns)))
    left_out: list[str] = []
    while True:
        table = _table(columns, kept, rows, table_options)
        droppable = [i for i in kept if columns[i].drop]
        natural = console.measure(table, options=console.options.update_width(2**20)).maximum  # unclamped
        if natural <= console.width or not droppable:
            return table, left_out
        first = min(droppable, key=lambda i: columns[i].drop)
        kept.remove(first)
        left_out.append(columns[first].header)


def print_fitted(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str]], **table_options) -> None:
    table, left_out = fitted_table(console, columns, rows, **table_options)
    console.print(table)
    if left_out:
        console.print(f"  ({', '.join(left_out)} left out at {console.width} columns: widen the terminal to see "
                      f"{'it' if len(left_out) == 1 else 'them'})", markup=False, highlight=False)


def _table(columns: Sequence[Column], kept: list[int], rows: Sequence[Sequence[str]], options: dict) -> Table:
    table = Table(**options)
    for i in kept:
        table.add_column(columns[i].header, justify=columns[i].justify, no_wrap=True)
    for row in rows:
        table.add_row(*(row[i] for i in kept))
    return table
