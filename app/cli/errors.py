"""What a user's mistake becomes: :class:`UsageError` naming the argument, and exit status 2."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

EXIT_USER_ERROR = 2


class UsageError(ValueError):
    """A bad argument found by the command line itself; the message names the argument."""


def is_user_error(e: BaseException) -> bool:
    """An error the user can fix: ours, analysis' InputError (any subclass, whichever module raised it), a
    manifest's, a model's or the store's."""
    if isinstance(e, (UsageError, argparse.ArgumentTypeError)):
        return True
    from headscope.analysis.errors import InputError
    from headscope.app.manifest_schema import ManifestError

    kinds = [InputError, ManifestError]
    # the rest are checked only where their module is loaded (importing it to check would load torch);
    # an error of that kind was raised by that module, so it is loaded
    for module, name in (("headscope.analysis.models", "ModelError"),
                         ("headscope.analysis.store", "StoreUnavailable"), ("headscope.analysis.store", "StoreWriteError"),
                         ("headscope.analysis.store", "StoreReadError")):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return isinstance(e, tuple(kinds))


@contextlib.contextmanager
def argument(name: str) -> Iterator[None]:
    """Report a user error raised inside (analysis' InputError, ModelError) as one about ``name``."""
    try:
        yield
    except Exception as e:
        if isinstance(e, UsageError) or not is_user_error(e) or isinstance(e, OSError):
            raise  # a store that cannot be opened or written is no argument's fault (StoreWriteError, ...)
        raise UsageError(f"argument {name}: {e}") from None
