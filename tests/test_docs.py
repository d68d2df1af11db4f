"""The documentation site builds with ``mkdocs build --strict`` (what ``make docs`` runs), offline.

One build (a few seconds: mkdocstrings reads the sources, it imports nothing) serves every test:
its pages exist, the API reference shows the docstrings of the code, and nothing is fetched from
the network when a page is opened.
"""

import ast
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    "index.html", "getting-started.html", "lightning.html", "poptorch-compatibility.html", "emulation.html",
    "performance.html", "scaling-out.html", "reports.html", "limitations.html", "architecture.html",
    "api/ipu_backend.html", "api/lightning_ipu.html",
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


def first_sentence(source: str, name: str) -> str:
    """The first sentence of the docstring of class or function ``name`` in ``source`` (a path
    from the repository root), without whitespace and the markup Markdown renders."""
    tree = ast.parse((ROOT / source).read_text())
    node = next(n for n in ast.walk(tree) if getattr(n, "name", None) == name)
    sentence = ast.get_docstring(node).split(". ")[0].split("\n\n")[0]
    return "".join(re.sub(r"[`*]|:\w+:", "", sentence).split())


@pytest.mark.parametrize("page", PAGES)
def test_page_is_built(site, page):
    assert (site / page).is_file()


@pytest.mark.parametrize("source, name", [
    ("ipu_backend/options.py", "Options"), ("ipu_backend/models.py", "trainingModel"),
    ("ipu_backend/runtime/executor.py", "PoplarExecutor"), ("ipu_backend/data/loader.py", "DataLoader"),
    ("ipu_backend/blocks.py", "BeginBlock"), ("ipu_backend/blocks.py", "PipelinedExecution"),
    ("ipu_backend/hardware.py", "IpuSpec"),
])
def test_api_reference_shows_ipu_backend_docstrings(site, source, name):
    assert first_sentence(source, name) in page_text(site / "api/ipu_backend.html")


@pytest.mark.parametrize("source, name", [
    ("lightning_ipu/strategy.py", "IPUStrategy"), ("lightning_ipu/accelerator.py", "IPUAccelerator"),
    ("lightning_ipu/precision.py", "IPUPrecision"),
])
def test_api_reference_shows_lightning_ipu_docstrings(site, source, name):
    assert first_sentence(source, name) in page_text(site / "api/lightning_ipu.html")


def test_pages_load_nothing_from_the_network(site):
    for page in PAGES:
        links = re.findall(r'<(?:link|script)[^>]+(?:href|src)="(https?://[^"]+)"', (site / page).read_text())
        assert links == [], f"{page} loads {links}"


def public_names() -> list[str]:
    """``ipu_backend.__all__``, read from its source."""
    names = []
    for node in ast.parse((ROOT / "ipu_backend/__init__.py").read_text()).body:
        if isinstance(node, ast.Assign):
            target = node.targets[0]
        elif isinstance(node, ast.AugAssign):
            target = node.target
        else:
            continue
        if getattr(target, "id", None) == "__all__":
            names += [element.value for element in node.value.elts]
    return names


def test_every_public_name_has_a_compatibility_row(site):
    names = public_names()
    assert "trainingModel" in names and "BeginBlock" in names
    compatibility = (site / "poptorch-compatibility.html").read_text()
    assert [n for n in names if not re.search(rf"<code>(poptorch\.)?{n}\b", compatibility)] == []
