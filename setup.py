"""Package layout: the repository's top-level folders install under the one import name ``headscope``.

The metadata is in pyproject.toml; this file only maps folders to package names, which pyproject's
``packages.find`` cannot do (it finds ``app``, never ``headscope.app``). Packages are discovered, never
listed: a new subpackage of ``app/``, ``analysis/`` or ``kernels/`` is installed without editing this.

    headscope/  -> headscope           the notebook API (``import headscope as hs``)
    app/        -> headscope.app       Dash pages, views, the CLI
    analysis/   -> headscope.analysis  everything that computes
    kernels/    -> headscope.kernels   attention kernels
    assets/     -> headscope/assets    browser JS and CSS (package data)
    data/       -> headscope/data      needles, haystack, probes, patching pairs (package data)
"""

from setuptools import find_packages, setup

CODE = ("app", "analysis", "kernels")
DATA = ("assets", "data")

packages = ["headscope"] + [f"headscope.{name}" for name in find_packages(include=[f"{c}*" for c in CODE])]

setup(
    packages=packages + [f"headscope.{d}" for d in DATA],
    package_dir={"headscope": "headscope", **{f"headscope.{d}": d for d in CODE + DATA}},
    package_data={"headscope": ["py.typed"], **{f"headscope.{d}": ["**/*"] for d in DATA}},
    include_package_data=False,
)
