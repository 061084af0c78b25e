"""Write the generated tables of docs/models.md from the code's own tables (quantkit.run.support):
architectures per method, family x method, VLM family x method, VLM towers, expert layouts, runtimes.

    python scripts/make_docs_tables.py           # rewrite the blocks in place
    python scripts/make_docs_tables.py --check   # exit 1 when the page differs from the code

Each block sits between `<!-- generated: NAME (python scripts/make_docs_tables.py) -->` and
`<!-- end generated -->`; the prose around the blocks is the page's own. tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when the page is stale")
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args()
    from quantkit.run.support import render

    text = args.page.read_text()
    fresh = render(text)
    if args.check:
        if fresh != text:
            print(f"{args.page} differs from the code's tables: run python scripts/make_docs_tables.py", file=sys.stderr)
            return 1
        return 0
    if fresh != text:
        args.page.write_text(fresh)
        print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
