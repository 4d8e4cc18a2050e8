"""The documentation's commands run: every code block marked ``<!-- runnable -->`` in the README and
in docs/ is run as it is written, from the repository's root, and must exit 0 (real jobs: a stale
option, a renamed example or a changed default fails here, not in a reader's shell)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = re.compile(r"<!-- runnable -->\n```(bash|python)\n(.*?)```", re.S)
PAGES = ["README.md", "docs/operating.md"]  # the pages with runnable blocks (using.md's are other tests' jobs)


def blocks(page: str) -> list[tuple[str, str]]:
    return RUNNABLE.findall((ROOT / page).read_text())


def test_every_page_links_to_pages_that_exist_and_the_readme_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]:
        for link in re.findall(r"\]\(((?:docs/)?[a-z_]+\.md)(?:#[^)]*)?\)", (ROOT / page).read_text()):
            assert (ROOT / Path(page).parent / link).exists(), f"{page} links to {link}, which does not exist"
    assert all(blocks(page) for page in PAGES), "a page lost its runnable example"


def test_the_readme_names_no_private_module_and_the_docs_nothing_outside_the_repository():
    """A reader of the README sees the public names only; a clone has every page a page links to
    (the design lives in docs/extending.md, not beside the repository)."""
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"elastic(?:\.[a-z]+)*\._[a-z]\w*", readme) == []
    pages = ["README.md", "CONTRIBUTING.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = (ROOT / page).read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text) + re.findall(r"`(\.\./[^`]+)`", text):
            if "://" in target:
                continue
            path = (ROOT / Path(page).parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{page} points to {target}, outside the clone"


@pytest.mark.fault
@pytest.mark.timeout(400)
@pytest.mark.parametrize("page", PAGES)
def test_the_runnable_blocks_of_the_documentation_run(page):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for language, code in blocks(page):
        command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{page}: {code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if "elastic.report" in code:
            assert "ETTR" in done.stdout, done.stdout[-2000:]
