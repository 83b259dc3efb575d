"""make plan-doc: rewrite the `make plan` outputs a doc quotes from the planner (planner/doc.py).

    python -m stages.plan_doc docs/real-model.md            # rewrites the file's make plan blocks
    python -m stages.plan_doc docs/real-model.md --check    # one error line and exit 2 if any is stale

Reads:  the doc, and what make plan reads for each block's arguments (no model, no hub)
Writes: the doc (atomically), unless --check
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.storage.files import write_text_atomic
from planner.doc import refresh
from stages.cli import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.plan_doc", description=__doc__.splitlines()[0])
    parser.add_argument("doc", type=Path, help="a Markdown file with make plan blocks")
    parser.add_argument("--check", action="store_true", help="only check: exit 1 if a block differs")
    args = parser.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    fresh = refresh(text)
    if fresh == text:
        print(f"{args.doc}: every make plan block is the planner's output")
        return 0
    if args.check:
        raise SystemExit(f"{args.doc}: a make plan block differs from the planner's output: run make plan-doc")
    write_text_atomic(args.doc, fresh)
    print(f"{args.doc}: make plan blocks rewritten")
    return 0


if __name__ == "__main__":
    cli(main)
