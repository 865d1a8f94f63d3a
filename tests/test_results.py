"""benchmarks/results keeps only runs behind quoted numbers, each with a manifest (docs/architecture.md).

Every folder in benchmarks/results has a MANIFEST.md (commit, command, CPU, where it is quoted), the
loose files are listed in the top-level MANIFEST.md, and every folder and file is named somewhere in
README.md, docs/ or benchmarks/RESULTS.md, or is the default output of a script there (benchmarks/*.py):
a run nobody quotes is a file nobody can check. benchmarks/RESULTS.md holds the current figures by topic
and stays short enough to read; docs/history.md holds how they came to be. Code and docs cite either by
a section's title, and a manifest's "Quoted in:" line names the sections that quote its folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BOOK = ROOT / "benchmarks" / "RESULTS.md"
HISTORY = ROOT / "docs" / "history.md"
DOCUMENTS = {"RESULTS.md": BOOK, "history.md": HISTORY}
MAX_BOOK_LINES = 800
MAX_RESULTS_BYTES = 5_000_000

pytestmark = pytest.mark.skipif(not RESULTS.is_dir(), reason="benchmarks/ is not beside this checkout")


def quoting_text() -> str:
    documents = [ROOT / "README.md", BOOK, *sorted((ROOT / "docs").glob("*.md")),
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


def test_the_results_stay_small_and_packed():
    """At most 5 MB in all, every large recording gzipped and every plot on a palette
    (benchmarks/pack_results.py does both), and an archived run still reads as a bench run."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pack_results import plots_to_pack, to_pack
    from specdec.bench.harness import read_results
    from specdec.cli_options import results_path

    assert sum(path.stat().st_size for path in RESULTS.rglob("*") if path.is_file()) <= MAX_RESULTS_BYTES
    assert to_pack(RESULTS) == [] and plots_to_pack(RESULTS) == []
    archived = results_path(str(RESULTS / "agent-loop-copy-zen4"))
    assert archived.name == "results.jsonl.gz"
    info, rows = read_results(archived)
    assert info["kind"] == "run" and len(rows) > 10


def test_every_result_is_quoted_in_the_docs():
    text = quoting_text()
    names = [path.name for path in RESULTS.iterdir() if path.name != "MANIFEST.md"]
    assert [name for name in names if not quoted(name, text)] == []
    assert quoted("peers", "see results/peers/") and not quoted("peers", "results/peers-avx2")


def cited_sections(text: str) -> list[tuple[str, str]]:
    """(document, title) for each section a text cites as RESULTS.md, "Title" or history.md, "Title"
    (also ("Title"), a Markdown link's [..](..RESULTS.md), "Title", and comment markers between lines)."""
    joined = re.sub(r"\n\s*(//|#)?\s*", " ", text)
    return [(document, " ".join(cite.split()))
            for document, cite in re.findall(r'(RESULTS\.md|history\.md)\)?[,;:]?\s*\(?\s*"([^"]+)"', joined)]


def headings(path: Path) -> list[tuple[int, str, int]]:
    """(level, title, line index) of every Markdown heading outside code blocks."""
    found, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#{1,6}) (.+)", line)
        if match:
            found.append((len(match.group(1)), match.group(2).strip(), number))
    return found


def section_texts(path: Path) -> dict[str, str]:
    """Each section's title -> its text, from its heading to the next heading of its level or above."""
    lines, marks = path.read_text().splitlines(), headings(path)
    texts = {}
    for index, (level, title, start) in enumerate(marks):
        end = next((line for lvl, _, line in marks[index + 1:] if lvl <= level), len(lines))
        texts[title] = "\n".join(lines[start:end])
    return texts


def citing_sources() -> list[Path]:
    return [*(ROOT / "src").rglob("*.py"), *(ROOT / "src").rglob("*.cpp"), *(ROOT / "src").rglob("*.h"),
            *(ROOT / "docs").glob("*.md"), ROOT / "README.md", BOOK, *(ROOT / "benchmarks").glob("*.py"),
            *(path for path in (ROOT / "tests").rglob("*.py") if path.name != Path(__file__).name)]


def test_every_cited_section_exists():
    """Code and docs cite measurements by the section titles of RESULTS.md (the current figures) and of
    docs/history.md (how they came to be): a renamed or missing section leaves a reader with nothing to
    check. "Title" is the placeholder the docs use to show the form."""
    titles = {document: [title for level, title, _ in headings(path) if level >= 2]
              for document, path in DOCUMENTS.items()}
    cites = [(path.name, document, cite) for path in citing_sources() for document, cite in
             cited_sections(path.read_text()) if cite != "Title"]
    assert len(cites) > 20
    assert {document for _, document, _ in cites} == set(DOCUMENTS)
    assert [cite for cite in cites if not any(cite[2] in title for title in titles[cite[1]])] == []
    assert cited_sections('see (benchmarks/RESULTS.md,\n  // "Attention: tiles")') == \
        [("RESULTS.md", "Attention: tiles")]
    assert cited_sections('[history](docs/history.md), "Issue 3"') == [("history.md", "Issue 3")]


def test_results_md_holds_the_current_figures_in_at_most_800_lines():
    """The book a newcomer reads: superseded figures go to docs/history.md."""
    lines = len(BOOK.read_text().splitlines())
    assert lines <= MAX_BOOK_LINES, \
        f"benchmarks/RESULTS.md has {lines} lines; move superseded figures to docs/history.md"


def quoted_in(manifest: str) -> list[str]:
    """The "Quoted in:" lines of a manifest (one per folder manifest, one per loose file's entry)."""
    return [line for line in manifest.splitlines() if "Quoted in:" in line]


def test_every_manifest_names_the_sections_that_quote_it():
    """A manifest's "Quoted in:" line names where its run is quoted now: sections of RESULTS.md or
    docs/history.md (checked: the section exists and names the run), other docs' sections, or the script
    whose default output it is."""
    texts = {document: section_texts(path) for document, path in DOCUMENTS.items()}
    entries = [(folder.name, (folder / "MANIFEST.md").read_text()) for folder in sorted(RESULTS.iterdir())
               if folder.is_dir()]
    listing = (RESULTS / "MANIFEST.md").read_text()
    entries += [(match.group(1), match.group(2)) for match in
                re.finditer(r"^## (\S+)\n(.*?)(?=^## |\Z)", listing, re.M | re.S)]
    problems = []
    for name, manifest in entries:
        lines = quoted_in(manifest)
        if len(lines) != 1 or not lines[0].split("Quoted in:", 1)[1].strip(" ."):
            problems.append((name, "one non-empty Quoted in: line"))
            continue
        for document, title in re.findall(r'(RESULTS\.md|history\.md), "([^"]+)"', lines[0]):
            text = texts[document].get(title)
            if text is None:
                problems.append((name, f"{document} has no section {title!r}"))
            elif not quoted(name, text):
                problems.append((name, f"{document}, {title!r} does not name it"))
    assert problems == []
