"""README.md's results summary states the same claim verdicts, for the same runs, as the measured
table of docs/results/demo.md ("Claims over three seeds"): a rerun recorded in one and not the
other, or a summary written from memory, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eval.claims import CLAIM_IDS, VERDICTS

REPO = Path(__file__).resolve().parents[1]
CELL_VERDICT = re.compile(r"^\**(" + "|".join(VERDICTS) + r")\**(:|$)")


def claim_table(text: str, after: str) -> dict[tuple[str, str], str]:
    """{(claim, column): verdict} of the first markdown table after the line starting with ``after``
    whose header begins ``| claim |``: each cell's leading verdict (bold or not; a figure may follow)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(after)), None)
    assert start is not None, f"no line starting {after!r}"
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("| claim |"))
    columns = [cell.strip() for cell in lines[header].strip("|").split("|")][1:]
    table = {}
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        claim, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        assert len(cells) == len(columns), f"{line!r}: {len(cells)} cells under {len(columns)} columns"
        for column, cell in zip(columns, cells, strict=True):
            match = CELL_VERDICT.match(cell)
            assert match, f"{claim}, {column}: {cell!r} opens with no verdict of {VERDICTS}"
            table[claim, column] = match.group(1)
    return table


def readme_verdicts(text: str) -> dict[tuple[str, str], str]:
    return claim_table(text, "What the earlier configuration showed")


def results_verdicts(text: str) -> dict[tuple[str, str], str]:
    return claim_table(text, "## Claims over three seeds")


def test_readme_states_the_verdicts_of_the_measured_runs():
    readme = readme_verdicts((REPO / "README.md").read_text(encoding="utf-8"))
    measured = results_verdicts((REPO / "docs" / "results" / "demo.md").read_text(encoding="utf-8"))
    # every claim of that configuration, judged on every seed (gfn_matches_target came after it)
    assert {claim for claim, _ in measured} == set(CLAIM_IDS) - {"gfn_matches_target"}
    assert readme == measured


def test_a_verdict_the_readme_misstates_is_found():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    row = "| gfn_reward_higher | holds | holds | holds |"
    assert row in text
    misstated = readme_verdicts(text.replace(row, "| gfn_reward_higher | fails | holds | holds |"))
    measured = results_verdicts((REPO / "docs" / "results" / "demo.md").read_text(encoding="utf-8"))
    assert misstated != measured and misstated[("gfn_reward_higher", "seed 0")] == "fails"


def test_cells_of_every_verdict_bold_or_with_a_figure_parse():
    text = "\n".join(
        [
            "## Claims over three seeds",
            "| claim | seed 0 | seed 1 |",
            "|---|---|---|",
            "| prm_auc | **holds**: 0.867 [0.836, 0.895] | inconclusive: 0.803 [0.759, 0.84] |",
            "| prm_slip_pair_auc | fails | **inconclusive** |",
        ]
    )
    assert results_verdicts(text) == {
        ("prm_auc", "seed 0"): "holds",
        ("prm_auc", "seed 1"): "inconclusive",
        ("prm_slip_pair_auc", "seed 0"): "fails",
        ("prm_slip_pair_auc", "seed 1"): "inconclusive",
    }
    with pytest.raises(AssertionError, match="opens with no verdict"):
        results_verdicts(text.replace("| fails |", "| failed |"))


def test_the_readme_figures_of_the_exact_label_control_are_the_measured_ones():
    """The README's paragraph on `python -m prm.control` repeats slip-pair AUCs from
    docs/results/prm.md: each figure it states must stand in that page's measured tables."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("`python -m prm.control runs/<run>`")
    paragraph = readme[start : readme.index("\n\n", start)]
    figures = re.findall(r"\b0\.\d{3}\b", paragraph)
    assert len(figures) >= 3, paragraph
    measured = (REPO / "docs" / "results" / "prm.md").read_text()
    rows = [line for line in measured.splitlines() if line.startswith("|")]
    for figure in figures:
        assert any(f" {figure} " in row or f" {figure} [" in row for row in rows), f"{figure} not in a measured table"


def test_the_readme_figures_of_the_judged_pair_are_the_measured_ones():
    """The README's paragraph on the judged GFlowNet and PPO repeats make experiment's pooled figures
    from docs/results/demo.md ("The experiment's verdicts"): each signed figure must stand there."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index("What it compares since 2026-12-01")
    paragraph = readme[start : readme.index("\n\n", start)]
    figures = re.findall(r"[+-]\d+\.\d+", paragraph)
    assert len(figures) >= 6, paragraph
    page = (REPO / "docs" / "results" / "demo.md").read_text(encoding="utf-8")
    section = page[page.index("## The experiment's verdicts") :]
    section = section[: section.index("\n## ", 1)]
    missing = [figure for figure in figures if figure not in section]
    assert not missing, f"README figures not in docs/results/demo.md's experiment section: {missing}"


def test_the_readme_states_the_pooled_verdicts_of_the_experiment():
    """The README's table of make experiment's verdicts (pooled, and each verdict seed) is
    docs/results/demo.md's, claim by claim and column by column, and covers every claim."""
    readme = claim_table((REPO / "README.md").read_text(encoding="utf-8"), "The paper's experiment, judged")
    measured = claim_table(
        (REPO / "docs" / "results" / "demo.md").read_text(encoding="utf-8"), "## The experiment's verdicts"
    )
    assert {claim for claim, _ in measured} == set(CLAIM_IDS)
    assert {column for _, column in measured} == {"pooled", "seed 10", "seed 11", "seed 12"}
    assert readme == measured
