"""The ``headscope`` command: serve the app, run texts, list models and runs, rebuild figures.

Every argument is checked at this boundary, before anything heavy is imported (torch, transformers,
dash and the analysis modules load only after parsing and validation, so ``--help`` and a mistyped
argument answer at once). A bad input ends in one line on stderr that names the argument, and exit
status 2; progress bars are drawn only on a terminal.

Each command is a module of this package with two functions: ``add_parser(sub)`` declares its
arguments (each with a type that checks it) and ``cmd_<name>(args)`` runs it. The argument types,
errors and terminal output they share are in :mod:`.arguments`, :mod:`.errors`, :mod:`.terminal`,
:mod:`.loading` (the store and the model) and :mod:`.niah` (the needle-in-a-haystack sweep's options).
A module imports only what parsing needs; the rest is imported inside its command.
"""

from __future__ import annotations

import logging
import os
import sys

from headscope import __version__  # the installed distribution's, read from its metadata
from headscope.app.cli import (
    ablate,
    circuits,
    compare,
    compress,
    explain,
    figure,
    models,
    patch,
    run,
    runs,
    scan,
    serve,
    worker,
)
from headscope.app.cli.arguments import Parser, folder
from headscope.app.cli.errors import EXIT_USER_ERROR, is_user_error
from headscope.app.cli.terminal import one_line

# the order of `headscope --help`'s list
COMMANDS = (serve, worker, run, scan, ablate, compress, patch, circuits, explain, compare, models, runs, figure)


def build_parser() -> Parser:
    """The command line's arguments, each with a type that checks it (nothing heavy is imported)."""
    parser = Parser(prog="headscope", description="A workbench for attention heads.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--home", type=folder, help="store folder (default: $HEADSCOPE_HOME or the user data dir)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _quiet_libraries() -> None:
    """Off a terminal, silence transformers' and huggingface_hub's own progress bars (they write
    carriage returns into captured output)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # plain tqdm bars, e.g. transformers' GGUF conversion
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def _torch_cache_outside_tmp() -> None:
    """torch creates its compile cache folder when it is imported (``torch._dynamo.package`` asks
    ``torch._inductor`` for it), by default ``$TMPDIR/torchinductor_<user>``: a folder every command left in
    the temporary files, under a name any local user could create first. headscope compiles nothing with
    inductor; its processes (and the jobs and workers they start) keep that folder in headscope's own cache
    folder instead, unless ``TORCHINDUCTOR_CACHE_DIR`` names one."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        import platformdirs

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(platformdirs.user_cache_dir("headscope"), "torchinductor")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _torch_cache_outside_tmp()  # before anything imports torch
    if not sys.stderr.isatty():
        _quiet_libraries()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("headscope: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"headscope {args.command}: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR


