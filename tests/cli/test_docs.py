"""The flag reference and the module list are generated from the code and kept current."""

from __future__ import annotations

import argparse

from breakgraph import cli, docgen
from breakgraph.engine import flags
from breakgraph.models.sources import BUILTIN_MODELS


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    return {name: docgen._subparsers(cli.build_parser())[name] for name in docgen.SUBCOMMANDS}


def test_generated_docs_are_current():
    stale = docgen.stale()
    assert not stale, f"{', '.join(stale)} not current: run {docgen.COMMAND}"


def test_every_flag_says_what_it_does_and_what_its_default_means():
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{label} has no help text"
            if action.option_strings and action.nargs != 0 and action.default is None:
                assert "default" in action.help.lower(), f"{label}: what does None mean?"


def test_serve_help_groups_the_flags_and_shows_defaults():
    text = _subcommands()["serve"].format_help()
    for title in (
        flags.MODEL,
        flags.MEMORY,
        flags.SCHEDULING,
        flags.CUDA_GRAPHS,
        flags.PARALLELISM,
        flags.SERVER,
        flags.LOGGING,
    ):
        assert f"\n{title}:\n" in text
    assert "(default: 8192)" in " ".join(text.split())  # --chunked-prefill-size
    assert "(default: 0)" in " ".join(text.split())  # --seed: a zero default is shown too


def test_model_path_help_names_every_builtin_config():
    (action,) = [a for a in _subcommands()["serve"]._actions if "--model-path" in a.option_strings]
    assert BUILTIN_MODELS and all(name in action.help for name in BUILTIN_MODELS)


def test_structure_lists_every_module_once(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package. More."""\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text('"""Holds a, e.g. `x`. Then more.\n\nDetail."""\n')
    (pkg / "b.py").write_text("x = 1\n")
    lines = [
        line for line in docgen.structure_markdown(pkg).splitlines() if line.lstrip()[:1] == "-"
    ]
    assert lines == [
        "- `breakgraph/`: The package.",
        "- `b.py`: (no docstring)",
        "- `sub/`: (no docstring)",
        "  - `sub/a.py`: Holds a, e.g. `x`.",
    ]


def test_readme_model_table_names_every_architecture_and_builtin_config():
    from breakgraph.models.registry import MODEL_REGISTRY

    readme = (docgen.PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| `"))
    missing = [n for n in [*MODEL_REGISTRY, *BUILTIN_MODELS] if f"`{n}`" not in table]
    assert not missing, f"README.md's model table lacks {missing}"
