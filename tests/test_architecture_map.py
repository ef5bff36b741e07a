"""docs/architecture.md stays a map (issue 46): at most 30 KB, every path it names is in the tree,
and every citation of it, in code or docs, names a section it has.

Paths on the page are relative to `megapipe/` unless they start with a top-level folder (the
page's first paragraph); `train/step.update` names the module `train/step.py`. A path followed
by "(issue N)" is one that issue N creates and that is not merged yet: it may be absent, and the
test fails once it exists, so that the mark is dropped. Each check is shown to catch a planted
fault. The runnable commands of the docs are tests/test_docs_commands.py's; its page list is
reused here for the links into this page.
"""

import re
from pathlib import Path

from tests.conftest import ROOT
from tests.test_docs_commands import PAGES

PAGE = Path(ROOT, "docs", "architecture.md")
MAX_BYTES = 30_000
TOP = ("megapipe", "models", "tests", "tools", "benchmarks", "configs", "docs", ".ci")
LIBRARY = ("plan", "config", "data", "distributed", "parallel", "pipeline", "train", "perf")
LIBRARY += ("study", "cli")
SPAN = re.compile(r"`([^`\s]+)`")
BARE = re.compile(r"(?<![\w/.`-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|yaml|csv|sh))\b")
PENDING = re.compile(r"\s*\*?\(issue\s+(\d+)\)")
CITATION = re.compile(r"architecture\.md,\s*\"([^\"]+)\"")
ANCHOR = re.compile(r"architecture\.md#([\w-]+)")
CITING = ("megapipe", "models", "benchmarks", "tools", "tests", "docs")


def resolve(name: str, root: Path) -> Path | None:
    """The file or folder a path on the page names, or None where it is not a repo path."""
    name = name.rstrip(".,;:")
    first = name.split("/")[0]
    if "/" not in name or first not in TOP + LIBRARY:
        return None
    base = root if first in TOP else root / "megapipe"
    return base / name


def exists(path: Path) -> bool:
    """The path, a glob of it, or the module of `module.attribute` (`train/step.update`)."""
    if path.exists() or any(path.parent.glob(path.name)):
        return True
    stem = path.name
    while "." in stem:
        stem = stem.rsplit(".", 1)[0]
        if (path.parent / f"{stem}.py").exists():
            return True
    return False


def named_paths(text: str) -> list[tuple[str, bool]]:
    """(path, marked pending) for every repo path the text names, in code spans or bare."""
    found = []
    for match in SPAN.finditer(text):
        found.append((match.group(1), bool(PENDING.match(text, match.end()))))
    prose = SPAN.sub(" ", text)
    found += [(m.group(1), bool(PENDING.match(prose, m.end()))) for m in BARE.finditer(prose)]
    return found


def path_problems(text: str, root: Path) -> list[str]:
    problems = []
    for name, pending in named_paths(text):
        path = resolve(name, root)
        if path is None:
            continue
        if pending and exists(path):
            problems.append(f"`{name}` exists now: drop its (issue N) mark")
        elif not pending and not exists(path):
            problems.append(f"`{name}` is not in the tree ({path.relative_to(root)})")
    return problems


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def section_key(title: str) -> str:
    return title.replace("`", "").strip().rstrip("/").lower()


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def citation_problems(sources: dict[str, str], page: str) -> list[str]:
    """Every `architecture.md, "Section"` and `architecture.md#anchor` names a section of it."""
    titles = headings(page)
    sections = {section_key(t) for t in titles}
    anchors = {anchor(t) for t in titles}
    problems = []
    for where, text in sources.items():
        flat = " ".join(text.split())
        problems += [
            f'{where}: cites "{s}", not a section of docs/architecture.md'
            for s in CITATION.findall(flat)
            if section_key(s) not in sections
        ]
        problems += [
            f"{where}: links #{a}, not an anchor of docs/architecture.md"
            for a in ANCHOR.findall(flat)
            if a not in anchors
        ]
    return problems


def citing_sources() -> dict[str, str]:
    files = {p for d in CITING for p in Path(ROOT, d).rglob("*") if p.suffix in (".py", ".md")}
    files |= {Path(ROOT, "README.md"), Path(ROOT, "train.py"), *PAGES}
    files -= {PAGE, Path(__file__).resolve()}  # this file's citations are planted ones
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(files)}


def test_the_map_is_at_most_30_kb():
    size = PAGE.stat().st_size
    assert size <= MAX_BYTES, f"docs/architecture.md is {size} bytes > {MAX_BYTES}: trim it"


def test_every_path_on_the_map_is_in_the_tree():
    text = PAGE.read_text()
    assert len([n for n, _ in named_paths(text) if resolve(n, Path(ROOT))]) >= 100
    assert path_problems(text, Path(ROOT)) == []


def test_every_citation_of_the_map_names_a_section():
    sources = citing_sources()
    assert any(CITATION.search(" ".join(t.split())) for t in sources.values())
    assert citation_problems(sources, PAGE.read_text()) == []


def test_planted_faults_are_caught(tmp_path):
    (tmp_path / "megapipe" / "train").mkdir(parents=True)
    (tmp_path / "megapipe" / "train" / "step.py").write_text("")
    (tmp_path / "tools").mkdir()
    page = (
        "`train/step.update` and tools/ are fine; `train/gone.py` is not, nor is bare\n"
        "tools/gone.py; `train/new.py` *(issue\n 46)* may be absent, but `train/step.py`"
        " (issue 46) is merged; `1/128` and `F/B` are not paths."
    )
    assert path_problems(page, tmp_path) == [
        "`train/gone.py` is not in the tree (megapipe/train/gone.py)",
        "`train/step.py` exists now: drop its (issue N) mark",
        "`tools/gone.py` is not in the tree (tools/gone.py)",
    ]
    page = "# Map\n\n## One training step\n\n### `benchmarks/`\n"
    sources = {
        "a.py": 'docs/architecture.md, "One training step"; docs/architecture.md, "benchmarks"',
        "b.md": '[x](architecture.md#one-training-step) (architecture.md, "Old\n  section")',
        "c.md": "[y](architecture.md#layers)",
    }
    assert citation_problems(sources, page) == [
        'b.md: cites "Old section", not a section of docs/architecture.md',
        "c.md: links #layers, not an anchor of docs/architecture.md",
    ]
