"""The ``headscope`` command is a package with one module per command: each module declares its own
arguments (``add_parser``) and runs them (``cmd_<name>``), so a new command is a new module plus one
entry in ``COMMANDS``; and no module of the package imports anything heavy before the arguments are
checked (``--help`` answers at once, whichever command grows)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import subprocess
import sys

HEAVY = ("torch", "transformers", "dash", "plotly", "transformer_lens", "numpy", "headscope.analysis.models")


def _commands() -> dict[str, argparse.ArgumentParser]:
    from headscope.app.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_each_command_is_declared_and_run_by_its_own_module():
    from headscope.app.cli import COMMANDS

    commands = _commands()
    assert list(commands) == ["serve", "worker", "run", "scan", "ablate", "compress", "patch", "circuits", "explain",
                              "compare", "models", "runs", "figure"]
    assert [m.__name__.rsplit(".", 1)[1] for m in COMMANDS] == list(commands)
    for name, parser in commands.items():
        module = importlib.import_module(f"headscope.app.cli.{name}")
        func = parser.get_default("func")
        assert func is getattr(module, f"cmd_{name}"), name
        # the module's add_parser declares that command alone, with the options headscope --help shows
        alone = argparse.ArgumentParser(prog="headscope").add_subparsers()
        module.add_parser(alone)
        assert list(alone.choices) == [name]
        assert alone.choices[name].format_help() == parser.format_help()


def test_no_module_of_the_package_imports_anything_heavy():
    """Every module under app/cli/, imported in a fresh process, leaves torch, numpy, dash and the model
    code unloaded (they load inside a command, after parsing)."""
    import headscope.app.cli as package

    names = sorted(f"headscope.app.cli.{m.name}" for m in pkgutil.iter_modules(package.__path__)
                   if m.name != "__main__")
    assert len(names) >= 11
    probe = ("import importlib, sys\n"
             f"for name in {names!r}:\n"
             "    importlib.import_module(name)\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r}))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_python_dash_m_runs_the_command():
    """``python -m headscope.app.cli`` (docs/cli.md, the tests' servers) is the same command."""
    r = subprocess.run([sys.executable, "-m", "headscope.app.cli", "scan", "--lengths", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("headscope scan: argument --lengths: each value must be at least 1, got 0 "
                                "(see `headscope scan --help`)")
