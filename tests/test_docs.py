"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs), offline.

One build (about 10 s) serves every test: its pages exist, the API reference shows the docstrings
of the code, and nothing is fetched from the network when a page is opened.
"""

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ipu_backend
import lightning_ipu

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "index.html", "getting-started/index.html", "lightning/index.html",
    "poptorch-compatibility/index.html", "emulation/index.html", "performance/index.html",
    "limitations/index.html", "api/ipu_backend/index.html", "api/lightning_ipu/index.html",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site_dir)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return site_dir


def page_text(path: Path) -> str:
    """A rendered page's text, tags and whitespace dropped, entities decoded."""
    return "".join(html.unescape(re.sub(r"<[^>]+>", "", path.read_text())).split())


def first_sentence(obj) -> str:
    """The first sentence of an object's docstring, without whitespace and the markup Markdown renders."""
    sentence = inspect.getdoc(obj).split(". ")[0].split("\n\n")[0]
    return "".join(re.sub(r"[`*]|:\w+:", "", sentence).split())


@pytest.mark.parametrize("page", PAGES)
def test_page_is_built(site, page):
    assert (site / page).is_file()


@pytest.mark.parametrize("obj", [
    ipu_backend.Options, ipu_backend.trainingModel, ipu_backend.PoplarExecutor, ipu_backend.DataLoader,
    ipu_backend.BeginBlock, ipu_backend.PipelinedExecution, ipu_backend.IpuSpec,
], ids=lambda obj: obj.__name__)
def test_api_reference_shows_ipu_backend_docstrings(site, obj):
    assert first_sentence(obj) in page_text(site / "api/ipu_backend/index.html")


@pytest.mark.parametrize("obj", [lightning_ipu.IPUStrategy, lightning_ipu.IPUAccelerator, lightning_ipu.IPUPrecision],
                         ids=lambda obj: obj.__name__)
def test_api_reference_shows_lightning_ipu_docstrings(site, obj):
    assert first_sentence(obj) in page_text(site / "api/lightning_ipu/index.html")


def test_pages_load_nothing_from_the_network(site):
    for page in PAGES:
        links = re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', (site / page).read_text())
        assert links == [], f"{page} loads {links}"
