"""CLI verbs for unstructured pruning (SPEC C): rr, prune, sweep.

Imported by onnxdiag.cli; each command registers itself on the ``cli`` group.
"""

from __future__ import annotations

import click  # noqa: F401

from .cli import _common, _emit, cli, data_options, output_options, sampling_options  # noqa: F401
