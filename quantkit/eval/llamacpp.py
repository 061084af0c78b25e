"""Optional cross-check of a .gguf with llama.cpp's own `llama-perplexity`, when a build exists.

The binary is found in $QUANTKIT_LLAMA_CPP (a bin directory), then $QUANTKIT_ENGINES/llama.cpp/bin
(scripts/setup_engines.sh; QUANTKIT_ENGINES defaults to ~/.cache/quantkit/engines), then
third_party/llama.cpp/bin (scripts/build_llamacpp.sh), then PATH. llama.cpp tokenizes the text
itself, so its perplexity is comparable across files it scores, not digit for digit with
quantkit's windows.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from quantkit.errors import InputError, InternalError

PPL_LINE = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
CHUNKS_LINE = re.compile(r"calculating perplexity over (\d+) chunks")


def find_binary(name: str = "llama-perplexity") -> Path | None:
    candidates = []
    if os.environ.get("QUANTKIT_LLAMA_CPP"):
        candidates.append(Path(os.environ["QUANTKIT_LLAMA_CPP"]) / name)
    engines = Path(os.environ.get("QUANTKIT_ENGINES") or "~/.cache/quantkit/engines").expanduser()
    candidates.append(engines / "llama.cpp" / "bin" / name)
    candidates.append(Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "bin" / name)
    found = shutil.which(name)
    if found:
        candidates.append(Path(found))
    return next((c for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def perplexity(gguf_path: Path, text: str, context: int, threads: int = 2) -> dict:
    """Run llama-perplexity on `text` (as many chunks of `context` tokens as it holds);
    returns {"ppl", "ppl_stderr", "context", "chunks"}."""
    exe = find_binary()
    if exe is None:
        raise InputError("llama-perplexity not found", hint="build it with scripts/build_llamacpp.sh, "
                         "or set QUANTKIT_LLAMA_CPP to a llama.cpp bin directory")
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as fh:
        fh.write(text)
        fh.flush()
        cmd = [str(exe), "-m", str(gguf_path), "-f", fh.name, "-c", str(context), "-t", str(threads),
               "-b", str(context)]
        for _attempt in range(6):  # llama.cpp's log thread occasionally drops the last lines at exit (more under load)
            result = subprocess.run(cmd, capture_output=True, text=True)
            match = PPL_LINE.search(result.stdout + result.stderr)
            if match or result.returncode != 0:
                break
    if result.returncode != 0 or not match:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if " E " in line or "error" in line]
        reason = lines[-1].strip() if lines else f"exit code {result.returncode}, no final estimate"
        raise InternalError(f"llama-perplexity failed on {gguf_path.name}: {reason}")
    chunks = CHUNKS_LINE.search(result.stdout + result.stderr)
    return {"ppl": float(match.group(1)), "ppl_stderr": float(match.group(2)), "context": context,
            "chunks": int(chunks.group(1)) if chunks else None}
