"""The docs as a newcomer meets them: the README opens with the two commands, stays short, and
reaches every page under docs/; every relative link resolves; no code comment quotes a timing
(measured figures live in docs/results/, with their commit)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
TIMING = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|µs|us)\b|\d(?:[\d.]*\d)?\s?s\b(?!\.e\.)(?! ?(?:at most|timeout))"
                    r"|\d(?:\.\d+)?\s?[x×] (?:faster|slower)")


def links(page: Path) -> list[Path]:
    return [(page.parent / target).resolve() for target in LINK.findall(page.read_text())
            if not target.startswith(("http://", "https://", "mailto:"))]


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert blocks[:2] == ["bash .ci/setup && .venv/bin/minirl init demo && .venv/bin/minirl run demo",
                          "bash .ci/setup && .venv/bin/python -m pytest -n 2"]
    assert text.index("```bash") < text.index("\n## ")  # nothing before them but the title
    assert len(text.splitlines()) <= 250


def test_every_docs_page_is_reached_from_the_readme_and_every_link_resolves():
    seen, todo, broken = set(), [ROOT / "README.md"], []
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)} → {target}")
            elif target.is_dir():
                todo.extend(sorted(target.glob("*.md")))
            elif target.suffix == ".md":
                todo.append(target)
    assert broken == []
    pages = set((ROOT / "docs").rglob("*.md"))
    assert sorted(str(p.relative_to(ROOT)) for p in pages - seen) == []


def test_no_code_comment_quotes_a_timing():
    quoted = []
    for path in sorted([*(ROOT / "minirl").rglob("*.py"), *(ROOT / "cli").rglob("*.py"), *(ROOT / "rewards").rglob("*.py")]):
        src = path.read_text()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            is_comment = tok.type == tokenize.COMMENT
            is_docstring = tok.type == tokenize.STRING and tok.string.startswith(('"""', "'''"))
            if (is_comment or is_docstring) and TIMING.search(tok.string):
                quoted.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {TIMING.search(tok.string).group(0)!r}")
    assert quoted == []


def test_every_verification_row_is_short_and_its_full_text_is_reached():
    """#83: one short row per capability (where, commit, the figure that matters, a link); a row's
    history lives on the results page it links to, under a heading its link names."""
    page = ROOT / "docs" / "verification.md"
    rows = [line for line in page.read_text().splitlines() if line.startswith("| ")]
    assert rows and [len(r) for r in rows if len(r) >= 600] == []
    history = ROOT / "docs" / "results" / "verification-history.md"
    headings = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^## (.+)$", history.read_text(), flags=re.M)}
    anchors = re.findall(r"results/verification-history\.md#([^)]+)\)", page.read_text())
    assert anchors and set(anchors) <= headings
