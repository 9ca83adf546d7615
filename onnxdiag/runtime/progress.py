"""Progress bars on stderr for long passes (silent when stderr is not a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def progress(
    iterable: Iterable,
    total: int | None,
    label: str,
    *,
    step: Callable[[Any], int] | None = None,
) -> Iterator:
    """Yield from ``iterable`` with a click progress bar on stderr.

    Silent (no output, click not imported) when stderr is not a terminal.  Each item
    advances the bar by ``step(item)`` (default 1) out of ``total`` (None: unknown).
    """
    if not sys.stderr.isatty():
        yield from iterable
        return
    import click  # lazily: only the CLI and this bar use click

    if total is None:  # unknown length: click counts items
        with click.progressbar(iterable, label=label, file=sys.stderr) as bar:
            yield from bar
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        for item in iterable:
            yield item
            bar.update(step(item) if step else 1)
