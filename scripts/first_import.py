#!/usr/bin/env python
"""Where a module is first imported during a quantkit CLI run: the stack of each first import.

Runs `quantkit ARGS...` in this process with a sys.meta_path finder that, the first time MODULE
is really imported (not merely looked up with importlib.util.find_spec), prints the Python stack
that imports it, then lets the import go on. Ends with whether MODULE is loaded.

Usage: python scripts/first_import.py MODULE [--all] -- ARGS...
  e.g. python scripts/first_import.py torch -- quantize ./model --method gguf --imatrix none \\
           --eval-windows 0 -o /tmp/out --overwrite
--all: also print the stack of the first import of each submodule (MODULE.x), until MODULE is loaded.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quantkit


class FirstImport:
    """A finder that finds nothing (find_spec returns None): it prints the importing stack of `module` and steps aside."""

    def __init__(self, module: str, submodules: bool, out):
        self.module, self.submodules, self.out = module, submodules, out

    def find_spec(self, name, path=None, target=None):
        wanted = name == self.module or (self.submodules and name.startswith(self.module + "."))
        if wanted and name not in sys.modules and self.really_importing():
            print(f"=== first import of {name}", file=self.out)
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib._bootstrap" not in f.filename]
            print("".join(traceback.format_list(frames)), file=self.out)
            if name == self.module and not self.submodules:
                sys.meta_path.remove(self)

    @staticmethod
    def really_importing() -> bool:
        """True inside the import system's _find_and_load (False for importlib.util.find_spec)."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "_find_and_load":
                return True
            if frame.f_code.co_name == "find_spec" and "importlib" in frame.f_code.co_filename:
                return False
            frame = frame.f_back
        return False


def main() -> int:
    argv = sys.argv[1:]
    cli_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module")
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = sys.__stderr__
    sys.meta_path.insert(0, FirstImport(args.module, args.all, out))
    sys.argv = ["quantkit", *cli_args]
    from quantkit.cli.app import main as cli_main

    code = 0
    try:
        cli_main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    print(f"=== {args.module} loaded at the end: {args.module in sys.modules} (exit {code})", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
