"""``headscope figure``: rebuild a figure from an export's manifest."""

from __future__ import annotations

import contextlib
from pathlib import Path

from headscope.app.cli.arguments import check_formats, folder, non_empty
from headscope.app.cli.errors import UsageError, argument, is_user_error
from headscope.app.cli.loading import open_store
from headscope.app.cli.terminal import progress_bar
from headscope.app.export_formats import FIGURE_FORMATS


def cmd_figure(args) -> int:
    from headscope.app.manifest_schema import ManifestError, read_manifest_file

    try:
        manifest = read_manifest_file(args.manifest)
    except ManifestError as e:
        raise UsageError(f"argument manifest: {e}") from None
    formats = check_formats(args.formats) if args.formats else FIGURE_FORMATS
    from headscope.app.export import rebuilding, write_files
    from headscope.app.views import VIEWS

    if manifest["view"] not in VIEWS:
        raise UsageError(f"argument manifest: field 'view' names an unknown view {manifest['view']!r}; "
                         f"known: {', '.join(VIEWS)}")
    out = Path(args.out) if args.out else Path(args.manifest).resolve().parent / "regenerated"
    with contextlib.ExitStack() as stack:
        with progress_bar("rebuilding") as bar:
            store = open_store(args)
            try:  # the model: --model, else a spec on offer that the manifest names (never a path it names)
                with argument("manifest"):
                    again = stack.enter_context(rebuilding(manifest, store=store, model=args.model))
            except (UsageError, OSError):
                raise  # the store or the disk (StoreReadError, ...) says what it is itself
            except Exception as e:
                if is_user_error(e):
                    raise
                # an edited manifest whose params, settings or carried results the view cannot draw
                raise UsageError(f"argument manifest: the view {manifest['view']!r} cannot be drawn from this "
                                 f"manifest's params, settings or results ({type(e).__name__}: {str(e)[:200]})"
                                 ) from None
            bar(1.0)
        # inside the rebuild (the results it read live until its end): the new manifest carries them on
        paths = write_files(again.run, manifest["view"], again.params, out, formats,
                            drawn=(again.figure, again.rows, again.reads))
    for p in paths:
        print(p)
    return 0


def add_parser(sub) -> None:
    """``headscope figure MANIFEST``."""
    p = sub.add_parser("figure", help="rebuild a figure from an export's manifest.json")
    p.add_argument("manifest")
    p.add_argument("--model", type=non_empty("the model spec"),
                   help="the model to rebuild with, when the manifest's is not on offer here (a .gguf file or "
                        "folder of its own: a manifest never names a path to load); its digest must match")
    p.add_argument("--out", type=folder)
    p.add_argument("--formats", default="")
    p.set_defaults(func=cmd_figure)
