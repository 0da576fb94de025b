"""The package layout is the architecture: lower layers never import upper ones, policies need no model code, the
public names and every CLI command and option survive moves, and no command module grows past one screenful
of commands."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import castspec
from castspec.bench.runner import ITEM_DRAFTERS, METHOD_OPTIONS, parse_methods
from castspec.cli import build_parser

PACKAGE = Path(castspec.__file__).parent

# layer (a folder, or a top-level module) -> castspec modules it must never import, at the top or inside a function
FORBIDDEN = {
    "decode": ("castspec.serve", "castspec.bench", "castspec.cli", "castspec.api", "castspec.heads",
               "castspec.costs.profile", "castspec.costs.probe"),
    "policies": ("castspec.serve", "castspec.bench", "castspec.cli", "castspec.api", "castspec.heads",
                 "castspec.drafters", "castspec.models", "castspec.costs.profile", "castspec.costs.probe",
                 "castspec.costs.online", "castspec.decode.target", "castspec.decode.kv", "castspec.decode.engine",
                 "castspec.decode.verify", "castspec.decode.drafting"),
    "drafters": ("castspec.serve", "castspec.bench", "castspec.cli", "castspec.api", "castspec.heads",
                 "castspec.costs", "castspec.decode.engine"),
    "costs": ("castspec.serve", "castspec.bench", "castspec.cli", "castspec.api", "castspec.heads"),
    "api.py": ("castspec.serve", "castspec.bench", "castspec.cli", "castspec.heads"),
    "heads": ("castspec.serve", "castspec.bench", "castspec.cli"),
    "serve": ("castspec.cli", "castspec.bench"),
    "bench": ("castspec.cli",),
}


def castspec_imports(path: Path) -> set[str]:
    """Every castspec module a file imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("castspec"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("castspec"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from castspec.x import y`
    return found


def layer_files(layer: str) -> list[Path]:
    target = PACKAGE / layer
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_never_import_upper_ones(layer):
    files = layer_files(layer)
    assert files, f"layer {layer} has no files"
    broken = [f"{path.relative_to(PACKAGE)} imports {module}"
              for path in files for module in sorted(castspec_imports(path))
              if any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN[layer])]
    assert not broken, "\n".join(broken)


def test_the_import_checker_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from castspec.serve.app import build_app\n    import castspec.cli\n")
    assert {"castspec.serve.app", "castspec.cli"} <= castspec_imports(source)


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement`."""
    code = f"import sys\n{statement}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout))


def test_policies_load_no_model_code():
    loaded = loaded_after("import castspec.policies.cast, castspec.policies.base")
    assert "transformers" not in loaded
    assert not {m for m in loaded if m.startswith(("castspec.drafters", "castspec.models", "castspec.decode.target",
                                                   "castspec.decode.kv", "castspec.decode.engine"))}


def test_the_decoding_core_loads_no_shell():
    loaded = loaded_after("import castspec.decode.engine, castspec.decode.verify, castspec.decode.drafting")
    assert not {m for m in loaded if m.startswith(("castspec.serve", "castspec.bench", "castspec.cli", "castspec.api"))}


def test_every_public_name_imports():
    for name in castspec.__all__:
        assert getattr(castspec, name) is not None, name
    from castspec import CastspecError, DraftTree, Engine, Generation  # noqa: F401 - the README's own imports

    with pytest.raises(AttributeError):
        castspec.no_such_name  # noqa: B018


def cli_surface(parser) -> dict:
    import argparse

    def walk(p, prefix: list[str], out: dict) -> dict:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, prefix + [name], out)
        if prefix:
            out[" ".join(prefix)] = {(a.option_strings[-1] if a.option_strings else a.dest): a.default
                                     for a in p._actions
                                     if a.dest != "help" and not isinstance(a, argparse._SubParsersAction)}
        return out

    return json.loads(json.dumps(walk(parser, [], {}), sort_keys=True, default=str))


def test_every_command_and_option_of_the_cli_is_kept():
    """tests/data/cli_surface.json is the CLI before the package was split into layers: every command, option and
    default must still be there (a new one is added to the file on purpose)."""
    expected = json.loads((Path(__file__).parent / "data" / "cli_surface.json").read_text())
    assert cli_surface(build_parser()) == expected


def test_every_command_runs_a_function():
    parser = build_parser()
    for command in cli_surface(parser):
        if command == "models":
            continue  # a group: fetch and list are its commands
        args = parser.parse_args(command.split() + required_placeholders(command))
        assert callable(args.run), command


def required_placeholders(command: str) -> list[str]:
    return {"generate": ["--model", "m", "--prompt", "p"], "serve": ["--model", "m"],
            "explain": ["--model", "m", "--prompt", "p", "--out", "o.png"], "bench-combine": ["r.json", "--name", "n"],
            "train-head": ["--target", "t", "--out", "o"], "regenerate": ["--target", "t", "--out", "o"],
            "head-vocab": ["--head", "h", "--target", "t", "--size", "8", "--out", "o"],
            "models fetch": ["smollm2-135m"]}.get(command, [])


def test_every_bench_item_parses():
    items = [f"{method}:{drafter}" for method in METHOD_OPTIONS if method != "ar" for drafter in ITEM_DRAFTERS]
    specs = parse_methods(";".join(["ar", "hf-assisted", "hf-prompt-lookup", *items]))
    assert len(specs) == 3 + len(items)


def test_command_modules_stay_small():
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines <= 250, f"{path.name} has {lines} lines: split the command group"
