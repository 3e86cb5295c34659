"""The file formats an export writes, by name: what ``--formats`` and the page's export buttons accept.

Kept apart from :mod:`headscope.app.export` (which loads plotly, the model code and torch) so that the command line
refuses a mistyped format at once, before anything heavy loads.
"""

IMAGE_FORMATS = ("png", "svg", "pdf")
FIGURE_FORMATS = (*IMAGE_FORMATS, "html")
DATA_FORMATS = ("csv", "json")
FORMATS = FIGURE_FORMATS + DATA_FORMATS
