"""A model by its Hub id, against a real Hub-compatible server on 127.0.0.1: olah (offline, serving local git
repos as models/ORG/NAME on branch main). `quantkit quantize org/name@main` end to end, the commit sha and
files recorded, the rerun from the cache with HF_HUB_OFFLINE=1, and every refusal before anything is
written (exit 2, one line and a hint). Skipped with the reason where olah is not installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import yaml

from tests.hub_server import CutProxy, Olah, free_port, git_repo, olah_command, point_at
from tests.util import FAST_CALIB, leftovers, subprocess_env

pytestmark = pytest.mark.skipif(olah_command() is None, reason="olah is not installed (pip install -e '.[dev]', or "
                                "QUANTKIT_TEST_OLAH=/path/to/olah-cli from an environment that has it)")

# What a run reads of the toy repo: the shards its index names; another *.safetensors beside them (as
# Mistral's repos ship consolidated.safetensors), its pickle duplicate and its subfolder never leave the server.
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
READ = {"config.json", "generation_config.json", "model.safetensors.index.json", *SHARDS, "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja", "README.md"}
HUB_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT", "HF_HOME",
                 "HF_HUB_CACHE")


class Hub(namedtuple("Hub", "olah repo sha")):
    def env(self, home: Path, endpoint: str | None = None, **extra: str) -> dict:
        env = subprocess_env(HF_ENDPOINT=endpoint or self.olah.endpoint, HF_HOME=str(home), **extra)
        for name in HUB_VARIABLES:
            if name not in ("HF_ENDPOINT", "HF_HOME") and name not in extra:
                env.pop(name, None)
        return env


def shard(model: Path) -> None:
    """model.safetensors split in two shards with their index, as transformers saves a larger model."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    halves = (names[: len(names) // 2], names[len(names) // 2:])
    for file, part in zip(SHARDS, halves):
        save_file({n: tensors[n] for n in part}, model / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: file for file, part in zip(SHARDS, halves) for n in part}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "model.safetensors").unlink()


@pytest.fixture(scope="module")
def hub(micro_model, tmp_path_factory):
    """olah on a free port over two git repos: org/tiny (the micro model in two shards, its card with a
    license, and files a run never reads: a consolidated.safetensors, a pickle, a subfolder) and org/pickles
    (pickle weights only)."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hub")
    repo = root / "mirrors" / "models" / "org" / "tiny"
    shutil.copytree(micro_model, repo)
    shard(repo)
    save_file({"decoy": torch.zeros(16)}, repo / "consolidated.safetensors")
    (repo / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 100_000)
    (repo / "original").mkdir()
    (repo / "original" / "params.json").write_text("{}")
    pickles = root / "mirrors" / "models" / "org" / "pickles"
    pickles.mkdir(parents=True)
    shutil.copy(micro_model / "config.json", pickles)
    (pickles / "pytorch_model.bin").write_bytes(b"\0" * 100_000)
    sha = git_repo(repo)
    git_repo(pickles)
    olah = Olah(root / "mirrors", root).start(olah_command())
    yield Hub(olah, repo, sha)
    olah.stop()


def quantize(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit", "quantize", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)


# The lightest run that reads the whole model: a GGUF Q8_0 without imatrix or gate imports no torch.
LIGHT = ("--method", "gguf", "--gguf-type", "Q8_0", "--imatrix", "none", "--eval-windows", "0")


def blobs(home: Path, repo: str = "org--tiny") -> dict[str, int]:
    folder = home / "hub" / f"models--{repo}" / "blobs"
    return {p.name: p.stat().st_size for p in folder.iterdir()} if folder.is_dir() else {}


@pytest.fixture(scope="module")
def fetched(hub, tmp_path_factory):
    """One run of `quantkit quantize org/tiny@main` into an empty cache: (home, out, report)."""
    root = tmp_path_factory.mktemp("fetched")
    home, out = root / "hf", root / "out"
    proc = quantize(hub.env(home), "org/tiny@main", "--method", "fp8", "-o", out, "--json", root / "r.json",
                    *FAST_CALIB)
    assert proc.returncode == 0, proc.stderr
    return home, out, json.loads((root / "r.json").read_text())


def test_the_run_records_the_commit_and_reads_only_what_it_needs(hub, fetched):
    home, out, report = fetched
    record = report["model"]["hub"]
    sizes = {name: (hub.repo / name).stat().st_size for name in READ}
    assert record["repo_id"] == "org/tiny" and record["revision"] == "main" and record["sha"] == hub.sha
    assert record["files"] == sizes and record["bytes"] == sum(sizes.values())
    assert report["recipe"]["model"] == f"org/tiny@{hub.sha}"  # a rerun of the recorded recipe reads this commit
    repo_bytes = sum(p.stat().st_size for p in hub.repo.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert sum(blobs(home).values()) == sum(sizes.values()) < repo_bytes  # no pickle, no subfolder
    assert json.loads((out / "quantkit.json").read_text())["model"]["hub"]["sha"] == hub.sha


def test_the_card_names_the_hub_model_and_shows_the_figure(fetched):
    _, out, _ = fetched
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "org/tiny" and front["base_model_relation"] == "quantized"
    assert front["license"] == "apache-2.0" and front["quantized_by"] == "quantkit"
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert (out / "kld.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](kld.png)" in card
    assert "model: org/tiny@" in card and "| perplexity |" in card


def test_a_rerun_offline_reads_the_same_commit_from_the_cache(hub, fetched, tmp_path):
    home, _, _ = fetched
    before = blobs(home)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: any request would fail
    proc = quantize(hub.env(home, closed, HF_HUB_OFFLINE="1"), "org/tiny@main", *LIGHT, "-o", tmp_path / "again",
                    "--json", tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["model"]["hub"]["sha"] == hub.sha
    assert blobs(home) == before


@pytest.fixture
def in_process_hub(hub, tmp_path, monkeypatch):
    """The hub library in this process pointed at olah and an empty cache (it reads HF_ENDPOINT and HF_HOME
    once, at import, into these constants)."""
    from huggingface_hub import constants

    point_at(monkeypatch, hub.olah.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf"


def refused(result, out: Path) -> list[str]:
    """The error's lines, after checking the exit code and that nothing is at or beside OUT."""
    assert result.exit_code == 2, result.output
    assert leftovers(out.parent, out.name) == []
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].strip().startswith("hint: "), lines
    return lines


@pytest.mark.parametrize("model, message", [
    ("org/none", "'org/none' is not a local directory, and http://127.0.0.1:"),
    ("org/tiny@nope", "org/tiny has no revision 'nope'"),
    ("org/pickles", "org/pickles holds only pickle weights"),
])
def test_a_bad_id_is_refused_before_anything_is_written(cli, in_process_hub, tmp_path, model, message):
    out = tmp_path / "out"
    lines = refused(cli("quantize", model, "--method", "fp8", "-o", out), out)
    assert message in lines[0]
    assert not any(size == 100_000 for size in blobs(in_process_hub, "org--pickles").values())  # the pickle stayed


def test_offline_without_the_model_in_the_cache(cli, in_process_hub, tmp_path):
    out = tmp_path / "out"
    lines = refused(cli("quantize", "org/tiny@main", "--method", "fp8", "--offline", "-o", out), out)
    assert "org/tiny@main is not in the Hugging Face cache" in lines[0] and "offline mode is on" in lines[0]


def test_no_network_and_no_cache(cli, in_process_hub, tmp_path, monkeypatch):
    point_at(monkeypatch, f"http://127.0.0.1:{free_port()}")
    out = tmp_path / "out"
    lines = refused(cli("quantize", "org/tiny", "--method", "fp8", "-o", out), out)
    assert "is not in the Hugging Face cache" in lines[0] and "the Hub cannot be reached" in lines[0]


def test_a_disk_too_small_for_the_download(cli, in_process_hub, tmp_path, monkeypatch):
    usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "out"
    lines = refused(cli("quantize", "org/tiny@main", "--method", "fp8", "-o", out), out)
    assert "not enough disk space for org/tiny: the download is 2.8 MiB" in lines[0]
    assert "model.safetensors" not in {p.name for p in (in_process_hub / "hub").rglob("*")}


def test_an_interrupted_download_is_exit_2_and_the_rerun_fetches_only_what_is_missing(hub, tmp_path):
    """The second shard cut halfway (its resume refused): exit 2, nothing at OUT; the rerun fetches that
    shard alone, the rest comes from the cache (a file cut short starts over: the hub library keeps none)."""
    home, out = tmp_path / "hf", tmp_path / "out"
    with CutProxy(hub.olah.port, SHARDS[1]) as proxy:
        proc = quantize(hub.env(home, proxy.endpoint), "org/tiny@main", *LIGHT, "-o", out)
        assert proc.returncode == 2, proc.stderr
        assert "the download of org/tiny stopped" in proc.stderr and "run the same command again" in proc.stderr
        assert leftovers(tmp_path, "out") == [] and proxy.cuts == 2  # the cut, and the resume refused
        kept = proxy.sent
        assert kept.get(SHARDS[0]) == (hub.repo / SHARDS[0]).stat().st_size and SHARDS[1] not in kept
        proxy.cutting, proxy.sent = False, {}
        proc = quantize(hub.env(home, proxy.endpoint), "org/tiny@main", *LIGHT, "-o", out)
        assert proc.returncode == 0, proc.stderr
        assert proxy.sent == {SHARDS[1]: (hub.repo / SHARDS[1]).stat().st_size}
    assert len(list(out.glob("*.gguf"))) == 1
