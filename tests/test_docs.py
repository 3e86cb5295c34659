"""docs/: every page the app registers has its screenshot, ``docs/screenshots/<page>.png`` (made by
``docs/screenshots.py``), 1280 px wide and small enough for a README. No server is started: the pages
are read from the app's page registry, as the script reads them."""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "screenshots.py"
SHOTS = ROOT / "docs" / "screenshots"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# the pages fixture lists the nav's pages in a process that imports the app: 10-30 s
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> list[str]:
    """The pages of the nav, from ``dash.page_registry`` (in a process of its own: creating the app
    registers the pages, which this process's other tests may do with their own settings)."""
    home = tmp_path_factory.mktemp("docs-home")
    out = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "HEADSCOPE_HOME": str(home)}, cwd=home)
    assert out.returncode == 0, out.stderr[-2000:]
    names = out.stdout.split()
    assert "attention" in names and "not_found_404" not in names  # the nav's pages, not the 404 page
    return names


def screenshots_module():
    spec = importlib.util.spec_from_file_location("docs_screenshots", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk, which the format puts first."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path.name} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_every_page_in_the_registry_has_its_screenshot(pages):
    missing = [f"docs/screenshots/{name}.png" for name in pages if not (SHOTS / f"{name}.png").is_file()]
    assert not missing, f"run .venv/bin/python docs/screenshots.py --only {' '.join(Path(m).stem for m in missing)}"


def test_every_page_in_the_registry_has_a_screenshot_recipe(pages):
    """A new page without a recipe would stop the script; this says so before anyone runs it."""
    assert sorted(screenshots_module().RECIPES) == sorted(pages)


def test_no_screenshot_of_a_page_that_is_gone(pages):
    stale = sorted(p.name for p in SHOTS.glob("*.png") if p.stem not in pages)
    assert not stale, f"docs/screenshots/ holds screenshots of no page: {stale}"


def test_screenshots_are_1280_px_wide_and_small(pages):
    for name in pages:
        path = SHOTS / f"{name}.png"
        if not path.is_file():
            continue  # said by the test above
        width, height = png_size(path)
        assert width == 1280 and 600 <= height <= screenshots_module().MAX_HEIGHT, (name, width, height)
        assert path.stat().st_size < 256 * 1024, f"{path.name}: {path.stat().st_size:,} bytes (crop it: save(bottom_of=...))"


def test_a_page_without_a_recipe_stops_the_script_before_any_server_starts(pages, monkeypatch):
    """A new page in the registry with no recipe: the script names it and stops, shooting nothing."""
    module = screenshots_module()
    monkeypatch.setattr(module, "registry_pages", lambda: [*pages, "glossary"])
    monkeypatch.setattr(module, "start_server", lambda home: pytest.fail("a server was started"))
    with pytest.raises(SystemExit, match="no screenshot recipe for page.s. glossary: add one to RECIPES"):
        module.main([])
    monkeypatch.setattr(module, "registry_pages", lambda: pages)
    with pytest.raises(SystemExit, match="no such page: qk2"):  # --only names pages of the registry only
        module.main(["--only", "qk2"])
