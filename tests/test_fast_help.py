"""``onnxdiag --help`` and ``onnxdiag CMD --help`` import no numerical library (numpy,
onnx, onnxruntime): each checked in a fresh interpreter."""

import json
import subprocess
import sys

import pytest

import onnxdiag
from onnxdiag.cli import COMMANDS

HEAVY = ("numpy", "onnx", "onnxruntime")

#: cli modules that still import a numerical library at import time (strict: the test
#: fails once they no longer do, so that the mark is removed). None left.
STILL_SLOW: dict[str, str] = {}

_CODE = """
import json, sys
from onnxdiag.cli import cli
try:
    cli({args!r}, prog_name="onnxdiag")
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "loaded": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def _help(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _CODE.format(args=args, heavy=HEAVY)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def _case(command):
    """A pytest param; xfail (strict) when the command's family is still slow. The group's
    own --help lists every command, so it needs every family."""
    modules = set(COMMANDS.values()) if command is None else {COMMANDS[command]}
    slow = sorted(m for m in modules if m in STILL_SLOW)
    marks = [pytest.mark.xfail(strict=True, reason="; ".join(STILL_SLOW[m] for m in slow))
             ] if slow else []
    return pytest.param(command, marks=marks, id=command or "onnxdiag")


def test_every_command_is_covered():
    """COMMANDS names every command, each in the module that registers it."""
    from onnxdiag.cli import load_all

    assert set(COMMANDS) == set(onnxdiag.CLI_VERBS) == set(load_all().commands)
    for name, module in COMMANDS.items():
        assert load_all().commands[name].callback.__module__ == f"onnxdiag.cli.{module}"


@pytest.mark.parametrize("command", [_case(None), *(_case(c) for c in sorted(COMMANDS))])
def test_help_imports_no_numerical_library(command):
    result = _help([command, "--help"] if command else ["--help"])
    assert result["code"] == 0
    assert result["loaded"] == []
