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


KLD_LINE = re.compile(r"Mean\s+KLD:\s+([-0-9.eE+]+)")


def run_perplexity(args: list, context: int, chunks: int, env: dict | None = None, threads: int = 2) -> str:
    """llama-perplexity's output for `args` over `chunks` chunks of `context` tokens (retried where its log thread
    dropped the last lines)."""
    exe = find_binary()
    if exe is None:
        raise InputError("llama-perplexity not found", hint="build it with scripts/build_llamacpp.sh")
    cmd = [str(exe), *map(str, args), "-t", str(threads), "-c", str(context), "-b", str(context), "--chunks",
           str(chunks)]
    for _attempt in range(6):
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        if "Mean    KLD" in result.stdout or "Final estimate" in result.stdout:
            return result.stdout
    raise InternalError(f"llama-perplexity failed: {result.stdout.strip().splitlines()[-1:]}")


def kl_divergence(gguf: Path, text_file: Path, base_file: Path, context: int, chunks: int, flags: list,
                  env: dict | None = None) -> float:
    """llama-perplexity --kl-divergence of `gguf` run with `flags` against the log-probs in `base_file` (written
    by a --kl-divergence-base run on the same text): its mean KLD over the second half of each chunk."""
    out = run_perplexity(["-m", gguf, "-f", text_file, "--kl-divergence-base", base_file, "--kl-divergence",
                          *flags], context, chunks, env)
    return float(KLD_LINE.search(out).group(1))


def chunk_windows(ids: list[int], bos: int | None, context: int, chunks: int):
    """The token windows llama-perplexity scores: BOS first where the vocabulary adds one, cut in chunks of
    `context`, each chunk's first token replaced by BOS. It scores positions context/2 .. context-2 of each."""
    import numpy as np

    ids = ([bos] if bos is not None else []) + list(ids)
    windows = np.array(ids[:chunks * context]).reshape(chunks, context)
    if bos is not None:
        windows[:, 0] = bos
    return windows


def added_bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp adds to a prompt of this file, or None."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def field(key, default=None):
        f = fields.get(key)
        return default if f is None else f.contents()

    return field("tokenizer.ggml.bos_token_id") if field("tokenizer.ggml.add_bos_token", False) else None
