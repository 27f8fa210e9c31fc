"""A plain aligned text table: what benches, the planner and calibration print beside their
JSON lines. Imports nothing of dropless."""
from __future__ import annotations

from typing import Any


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain aligned text table of `columns` from `rows` (floats to 3 significant digits).

    E.g. rows [{"a": 1.23456, "b": "x"}, {"a": 1234.5}] with columns ["a", "b"] give the lines
    '   a  b', '1.23  x', '1234   ' (right-aligned; a missing or None cell is empty).
    """
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)
    table = [columns] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table)
