"""What a new user reads at 80 columns (issue 44, item 10): every command's help whole (no option name
or default cut to an ellipsis), ``models list`` one line per model with the full paths on request,
and ``verispec --version``."""

import json

import pytest
import typer.main
from typer.testing import CliRunner

from verispec.cli import app
from verispec.models.registry import BUILTIN_MODELS

cli = CliRunner()
NARROW = {"COLUMNS": "80", "TERMINAL_WIDTH": "80"}


def commands() -> list[list[str]]:
    root = typer.main.get_command(app)
    found = []
    for name, command in root.commands.items():
        if hasattr(command, "commands"):
            found += [[name, sub] for sub in command.commands]
        else:
            found.append([name])
    return found


@pytest.mark.parametrize("command", commands(), ids=" ".join)
def test_help_is_whole_at_80_columns(command):
    result = cli.invoke(app, [*command, "--help"], env=NARROW)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "…" not in result.output, result.output
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)


def test_generate_help_shows_long_option_names_and_defaults_whole():
    text = cli.invoke(app, ["generate", "--help"], env=NARROW).output
    for whole in ("--num-speculative-tokens", "qwen2.5-coder-1.5b-instruct", "--draft-vocab-corpus"):
        assert whole in text


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    monkeypatch.delenv("VERISPEC_MODELS_READONLY", raising=False)
    return tmp_path


def test_models_list_is_one_line_per_model_at_80_columns(home):
    result = cli.invoke(app, ["models", "list"], env=NARROW)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    above_paths = lines[: next(i for i, line in enumerate(lines) if line.startswith("files"))]
    assert max(len(line) for line in above_paths) <= 80 and "…" not in result.output, result.output  # licences too
    table = lines[: next(i for i, line in enumerate(lines) if line.startswith("licences"))]
    for name, entry in BUILTIN_MODELS.items():
        row = [line for line in table if name in line]
        assert len(row) == 1, result.output
        assert f"{entry.arch} {entry.quantization}" in row[0] and row[0].rstrip().endswith("no"), result.output
    assert lines[-1] == f"  {home / 'models'}/NAME/FILE"


def test_models_list_paths_and_json_give_full_paths(home):
    paths = cli.invoke(app, ["models", "list", "--paths"], env=NARROW)
    assert paths.exit_code == 0, paths.output
    expected = {name: str(home / "models" / name / entry.file_name) for name, entry in BUILTIN_MODELS.items()}
    assert dict(line.split("\t") for line in paths.output.splitlines()) == expected
    rows = [json.loads(line) for line in cli.invoke(app, ["models", "list", "--json"]).output.splitlines()]
    assert {row["name"]: row["path"] for row in rows} == expected
    assert {row["cached"] for row in rows} == {"missing"}
    assert {row["name"]: row["size_bytes"] for row in rows} == {n: e.size_bytes for n, e in BUILTIN_MODELS.items()}


def test_version_prints_the_package_version():
    from importlib.metadata import version

    result = cli.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"verispec {version('verispec')}\n"


def test_generate_and_serve_share_one_default_method():
    # issue 44, item 14: one default for both commands (auto: plain where speculation would cost more)
    import typer

    from verispec.cli import app

    commands = typer.main.get_command(app).commands
    defaults = {
        name: next(p.default for p in commands[name].params if p.name == "method") for name in ("generate", "serve")
    }
    assert defaults == {"generate": "auto", "serve": "auto"}
