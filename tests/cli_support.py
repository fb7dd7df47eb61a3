"""The CLI over the tiny GGUF pair (``files``, a fixture of ``tests/cli/conftest.py``, or a test's
own): one Typer test runner, and ``verispec generate --json`` run on the files, its JSON line read
back (``tests/cli/test_gguf_cli.py``, ``tests/runners/kernels/test_kernel_notices.py``)."""

import json

from typer.testing import CliRunner

from verispec.cli import app

cli = CliRunner()


def generate_json(files, *extra):
    args = [
        "generate",
        "ab!c",
        "--target",
        str(files["target"]),
        "--draft",
        str(files["draft"]),
        "--json",
        "--max-tokens",
        "16",
    ]
    result = cli.invoke(app, args + list(extra))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])
