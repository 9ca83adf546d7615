"""Plain-text tables for terminals and report.txt."""

from __future__ import annotations

import csv
import io
import math

from .json import to_jsonable


def format_value(value, digits: int = 4) -> str:
    """Compact text for a table cell: floats to ``digits`` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    if isinstance(value, int) and abs(value) >= 10000:
        return f"{value:,}"
    return str(value)


def render_table(rows: list[dict], columns: list[str] | None = None, *, title: str | None = None,
                 max_rows: int | None = None) -> str:
    """Render rows (dicts) as an aligned text table; long tables say how many are shown."""
    if not rows:
        return (f"{title}\n" if title else "") + "(none)\n"
    columns = columns or list(rows[0])
    shown = rows if max_rows is None else rows[:max_rows]
    cells = [[format_value(r.get(c)) for c in columns] for r in shown]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(_is_number(r.get(c)) for r in shown) for c in columns]
    lines = [title] if title else []
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.rjust(w) if num else v.ljust(w)
                               for v, w, num in zip(row, widths, numeric)).rstrip())
    if max_rows is not None and len(rows) > max_rows:
        lines.append(f"(first {max_rows} of {len(rows)} rows; the JSON report has all)")
    return "\n".join(lines) + "\n"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or value is None


def rows_to_csv(rows: list[dict]) -> str:
    """Rows (dicts) as CSV text: columns from the union of keys in first-seen order,
    missing cells empty, values made JSON-like (NaN → empty)."""
    import csv
    import io

    from .json import to_jsonable

    rows = to_jsonable(rows)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(columns), restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


def dict_rows_csv(rows) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), extrasaction="ignore",
                                restval="")
        writer.writeheader()
        writer.writerows(to_jsonable(rows))
    return buf.getvalue()


def fmt3(x):
    return "-" if x is None else f"{x:.3f}"
