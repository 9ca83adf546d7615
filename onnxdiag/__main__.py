"""``python -m onnxdiag``: the console script."""

from .cli import main

main()
