"""CLI verbs for structured channel pruning (SPEC B6): prune-channels, prune-sweep.

Imported by onnxdiag.cli; each command registers itself on the ``cli`` group.
"""

from __future__ import annotations

import click  # noqa: F401

from .cli import _common, _emit, cli, data_options, output_options, sampling_options  # noqa: F401
