"""The documents' Python examples run as written, and the README stays a first screen."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


#: Where the Python blocks are examples (docs/API.md's are signatures).
EXAMPLES = [ROOT / "README.md", ROOT / "docs" / "LIBRARY.md"]


@pytest.mark.parametrize("document", EXAMPLES, ids=lambda p: p.name)
def test_python_examples_run(document):
    blocks = re.findall(r"```python\n(.*?)```", document.read_text(), re.S)
    assert blocks or document.name == "README.md", f"{document.name} has no Python example"
    for block in blocks:
        exec(compile(block, str(document), "exec"), {})


def test_readme_is_short_and_links_resolve():
    """Under 350 lines, the rest in ``docs/``; every relative link names a file that exists."""
    for document in DOCUMENTS:
        text = document.read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (document.parent / target).exists(), f"{document.name} links to missing {target}"
    assert len((ROOT / "README.md").read_text().splitlines()) < 350
