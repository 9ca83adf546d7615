"""``python -m onnxdiag.cli``: the console script."""

from . import main

main()
