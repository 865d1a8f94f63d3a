"""benchmarks/results keeps only runs behind quoted numbers, each with a manifest (docs/architecture.md).

Every folder in benchmarks/results has a MANIFEST.md (commit, command, CPU, where it is quoted), the
loose files are listed in the top-level MANIFEST.md, and every folder and file is named somewhere in
README.md, docs/ or benchmarks/RESULTS.md, or is the default output of a script there (benchmarks/*.py):
a run nobody quotes is a file nobody can check.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

pytestmark = pytest.mark.skipif(not RESULTS.is_dir(), reason="benchmarks/ is not beside this checkout")


def quoting_text() -> str:
    documents = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "benchmarks").glob("*.py"))]
    return "\n".join(path.read_text() for path in documents)


def quoted(name: str, text: str) -> bool:
    """name appears as a whole path part: not only as the prefix of a longer folder's name."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def test_every_results_folder_has_a_manifest_and_every_loose_file_is_listed():
    folders = [path for path in RESULTS.iterdir() if path.is_dir()]
    assert len(folders) > 10
    assert [folder.name for folder in folders if not (folder / "MANIFEST.md").is_file()] == []
    listing = (RESULTS / "MANIFEST.md").read_text()
    loose = [path.name for path in RESULTS.iterdir() if path.is_file() and path.name != "MANIFEST.md"]
    assert [name for name in loose if f"## {name}" not in listing] == []


def test_every_result_is_quoted_in_the_docs():
    text = quoting_text()
    names = [path.name for path in RESULTS.iterdir() if path.name != "MANIFEST.md"]
    assert [name for name in names if not quoted(name, text)] == []
    assert quoted("peers", "see results/peers/") and not quoted("peers", "results/peers-avx2")


def cited_sections(text: str) -> list[str]:
    """The section titles a text cites as RESULTS.md, "Title" (or ("Title"), comment markers dropped)."""
    joined = re.sub(r"\n\s*(//|#)?\s*", " ", text)
    return [" ".join(cite.split()) for cite in re.findall(r'RESULTS\.md[,;:]?\s*\(?\s*"([^"]+)"', joined)]


def test_every_cited_results_section_exists():
    """Code and docs cite measurements by RESULTS.md's section titles: a renamed or missing section
    leaves a reader with nothing to check."""
    titles = [line[3:] for line in (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
              if line.startswith("## ")]
    sources = [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.cpp"), *(ROOT / "docs").glob("*.md"),
               ROOT / "README.md", *(ROOT / "benchmarks").glob("*.py")]
    cites = [(path.name, cite) for path in sources for cite in cited_sections(path.read_text())]
    assert len(cites) > 20
    assert [(name, cite) for name, cite in cites if not any(cite in title for title in titles)] == []
    assert cited_sections('see (benchmarks/RESULTS.md,\n  // "Attention: tiles")') == ["Attention: tiles"]
