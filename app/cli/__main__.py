"""``python -m headscope.app.cli``: the ``headscope`` command, from any Python that has the package."""

import sys

from headscope.app.cli import main

sys.exit(main())
