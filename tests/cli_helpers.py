"""Shared helpers of the CLI tests: run a command in-process, check a user error."""

from click.testing import CliRunner

from onnxdiag.cli import cli


def run(*args):
    """Invoke ``onnxdiag ARGS…`` in this process (arguments converted with str)."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_user_error(result, fragment, *absent, out=None):
    """Exit status 1, one ``error: …`` line on stderr containing ``fragment``, no traceback,
    and none of the paths in ``absent`` / ``out`` written (no partial output)."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert fragment in err, err
    for path in (*absent, *([out] if out is not None else [])):
        assert not path.exists(), f"no partial output may be left behind: {path}"
