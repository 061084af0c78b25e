"""Write the generated tables of the docs pages from the code's own tables (quantkit.run.support):
docs/models.md's architectures per method, family x method, VLM family x method, VLM towers, expert
layouts and runtimes; docs/gate.md's default thresholds.

    python scripts/make_docs_tables.py           # rewrite the blocks in place
    python scripts/make_docs_tables.py --check   # exit 1 when a page differs from the code

Each block sits between `<!-- generated: NAME (python scripts/make_docs_tables.py) -->` and
`<!-- end generated -->`; the prose around the blocks is the page's own. tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when the page is stale")
    parser.add_argument("pages", nargs="*", type=Path, help="default: every docs/*.md")
    args = parser.parse_args()
    from quantkit.run.support import render

    stale = 0
    for page in args.pages or sorted(DOCS.glob("*.md")):
        text = page.read_text()
        fresh = render(text)
        if fresh == text:
            continue
        if args.check:
            print(f"{page} differs from the code's tables: run python scripts/make_docs_tables.py", file=sys.stderr)
            stale += 1
        else:
            page.write_text(fresh)
            print(f"wrote {page}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
