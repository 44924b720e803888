"""The documents stay written for their readers: the README fits one sitting,
no document narrates numbered work sessions, and every section of
docs/DESIGN.md that code or documents cite exists.

Pure Python: reads the files, no Spark. Each check is a function of text, so a
test can show it failing on a broken input."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 400

# Documents a reader meets (the benchmark's and the design's included).
DOCUMENTS = ("README.md", "BENCHMARKS.md", "bench/README.md", "docs/*.md")

_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
             "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth "
             "thirtieth").split()
_TENS = r"(?:twenty|thirty)-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
# A numbered work session: "the twenty-sixth session", "session 12", "sessions 26–27",
# "s19 session", "12th session". Not "Spark session", "embedded session", "method: session".
SESSION = re.compile(
    r"\b(?:(?:" + "|".join(_ORDINALS) + r"|" + _TENS + r")\s+sessions?\b"
    r"|sessions?\s+\d+"
    r"|s\d+\s+sessions?\b"
    r"|\d+(?:st|nd|rd|th)\s+sessions?\b)",
    re.IGNORECASE)

# "DESIGN.md §3" (also "docs/DESIGN.md §3", "DESIGN.md §5, PARTITION")
CITATION = re.compile(r"DESIGN\.md\s+§\s*(\d+)")
# A numbered section of DESIGN.md: "## 3. The delta rules"
SECTION = re.compile(r"^##\s+(\d+)\.\s+\S", re.MULTILINE)
# A link into DESIGN.md by anchor: "DESIGN.md#3-the-delta-rules"
ANCHOR = re.compile(r"DESIGN\.md#([A-Za-z0-9_-]+)")


def too_long(text: str, limit: int = README_MAX_LINES) -> bool:
    return len(text.splitlines()) > limit


def session_references(text: str) -> list[str]:
    """Each line that mentions a numbered work session."""
    return [line.strip() for line in text.splitlines() if SESSION.search(line)]


def sections(design: str) -> set[int]:
    return {int(n) for n in SECTION.findall(design)}


def missing_citations(text: str, design: str) -> list[str]:
    """The "DESIGN.md §N" citations in ``text`` whose section N is not a heading
    of ``design``."""
    have = sections(design)
    return [m.group(0) for m in CITATION.finditer(text) if int(m.group(1)) not in have]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def missing_anchors(text: str, design: str) -> list[str]:
    anchors = {slug(h) for h in re.findall(r"^#{1,6}\s+(.+)$", design, re.MULTILINE)}
    return [a for a in ANCHOR.findall(text) if a not in anchors]


def _documents() -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in REPO.glob(pattern)})


def _design() -> str:
    return (REPO / "docs" / "DESIGN.md").read_text()


def _citing_files() -> list[Path]:
    return sorted(REPO.glob("dbt_ivm/**/*.py")) + _documents()


def test_readme_fits_one_sitting():
    readme = (REPO / "README.md").read_text()
    assert not too_long(readme), f"README.md has {len(readme.splitlines())} lines (at most {README_MAX_LINES})"


def test_no_document_narrates_numbered_sessions():
    found = {str(p.relative_to(REPO)): session_references(p.read_text()) for p in _documents()}
    found = {k: v for k, v in found.items() if v}
    assert not found, found


def test_every_cited_design_section_exists():
    design = _design()
    assert sections(design), "docs/DESIGN.md has no numbered sections (## N. Title)"
    missing = {str(p.relative_to(REPO)): missing_citations(p.read_text(), design) for p in _citing_files()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, missing


def test_every_link_into_design_names_a_heading():
    design = _design()
    missing = {str(p.relative_to(REPO)): missing_anchors(p.read_text(), design) for p in _documents()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, missing


def test_the_checks_fail_on_broken_input():
    """Each check catches what it is for, and lets the legitimate uses pass."""
    assert too_long("x\n" * 401) and not too_long("x\n" * 400)
    for bad in ("measured in the twenty-sixth session", "the Twentieth session's run", "first session",
                "(session 12)", "sessions 26–27", "the s19 session", "the 12th session"):
        assert session_references(bad), bad
    for good in ("the embedded Spark session", "method: session", "each dbt thread gets its own Spark session",
                 "session confs set with SET", "`SparkSession.newSession()`", "the `session` extra",
                 "results s26_small and s27_10m_10pct"):
        assert not session_references(good), good
    design = "# D\n\n## 1. Architecture\n\n## 3. The delta rules\n"
    assert missing_citations("State layout (DESIGN.md §2), rules (DESIGN.md §3)", design) == ["DESIGN.md §2"]
    assert missing_citations("see docs/DESIGN.md §1 and DESIGN.md §3", design) == []
    assert sections("## Architecture\n") == set()
    assert missing_anchors("[x](docs/DESIGN.md#3-the-delta-rules) [y](docs/DESIGN.md#2-state)", design) == [
        "2-state"]


def config_rows(text: str) -> list[str]:
    """The keys of the README's configuration table, in order."""
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|\s*`([a-z_]+)`\s*\|", section, re.MULTILINE)


def test_the_readme_lists_every_config_key_the_materialization_reads():
    from dbt_ivm.config import KEYS

    assert config_rows((REPO / "README.md").read_text()) == list(KEYS)
    assert config_rows("## Configuration\n| `ivm_policy` | x |\n## Next\n| `ivm_other` | y |") == ["ivm_policy"]
