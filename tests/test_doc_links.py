"""Every relative markdown link in README.md and docs/ (docs/results/ included) reaches its file,
and its heading when it names one: moving a measured section to its results page, or renaming a
page, cannot leave a link behind."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCED = re.compile(r"```.*?```", re.S)


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCED.sub("", page.read_text(encoding="utf-8"))
    return {heading_anchor(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}


def broken_links(pages: list[Path], root: Path = REPO) -> list[str]:
    broken = []
    for page in pages:
        text = FENCED.sub("", page.read_text(encoding="utf-8"))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path) if path else page
            where = page.relative_to(root)
            if not linked.exists():
                broken.append(f"{where}: {target}: no such file")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{where}: {target}: no such heading")
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    assert broken_links(pages) == []


def test_a_link_to_a_moved_page_or_heading_is_reported(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Measured (2026)\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#measured-2026) [gone](old.md) [heading](a.md#measured)\n```\n[code](x.md)\n```\n")
    assert broken_links([page], tmp_path) == ["b.md: old.md: no such file", "b.md: a.md#measured: no such heading"]
