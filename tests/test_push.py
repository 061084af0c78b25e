"""Pushing to the Hub through huggingface_hub's real client, against tests/hub_server.PushHub on 127.0.0.1 (the
part of the Hub's HTTP API a push calls: whoami, repo info, create, validate-yaml, preupload, the LFS batch API,
commit), recording what arrives. Xet is off in these runs (HF_HUB_DISABLE_XET=1): the client uploads large
files through LFS, which the server speaks; Xet's storage protocol it does not."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hub_server import PushHub, point_at
from tests.util import FAST_CALIB, leftovers, subprocess_env

TOKENS = {"write-token": ("write", None), "read-token": ("read", None), "stranger-token": ("write", ["stranger"])}
RECIPE = """
targets:
  - {name: fp8, method: fp8}
  - {name: fp8-block, method: fp8, options: {scheme: fp8-block}}
push: {repo: "org/tiny-{name}"}
"""


@pytest.fixture(scope="module")
def server():
    with PushHub(TOKENS) as hub:
        yield hub


def hub_env(server: PushHub, home: Path, token: str | None = "write-token") -> dict:
    env = subprocess_env(HF_ENDPOINT=server.endpoint, HF_HOME=str(home), HF_HUB_DISABLE_XET="1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE"):
        env.pop(name, None)
    return {**env, "HF_TOKEN": token} if token else env


@pytest.fixture(scope="module")
def dist(server, micro_model, tmp_path_factory):
    """One run of a two-target recipe whose `push:` sends each target to its own repo: (OUT, report, stdout)."""
    root = tmp_path_factory.mktemp("dist")
    (root / "recipe.yaml").write_text(RECIPE)
    proc = subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(micro_model), "--recipe",
                           str(root / "recipe.yaml"), "-o", str(root / "dist"), "--json", str(root / "r.json"),
                           *FAST_CALIB], env=hub_env(server, root / "hf"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return root / "dist", json.loads((root / "r.json").read_text()), proc.stdout


def test_quantize_pushes_each_passing_target_in_one_commit(server, dist):
    out, report, stdout = dist
    for target in report["targets"]:
        repo_id, folder = f"org/tiny-{target['name']}", out / target["name"]
        repo = server.recorded.repos[repo_id]
        assert len(repo.commits) == 1 and target["push"]["commit"] == repo.head
        assert repo.commits[0]["summary"] == f"quantkit: {target['name']} (fp8) gate PASS"
        local = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert set(repo.files) == local and "kld.png" in local
        assert all(server.file(repo_id, name) == (folder / name).read_bytes() for name in local)
        assert (server.recorded.lfs[repo.files["model.safetensors"][0]] == (folder / "model.safetensors").read_bytes())
        url = f"{server.endpoint}/{repo_id}/commit/{repo.head}"
        assert target["push"]["commit_url"] == url and f"pushed {target['name']}: {url}" in stdout
        front = yaml.safe_load(server.file(repo_id, "README.md").decode().split("---")[1])
        assert front["library_name"] == "transformers" and front["quantized_by"] == "quantkit"
        assert "base_model" not in front  # a local checkpoint: no path on the Hub
        assert f"From the Hub: `vllm serve {repo_id}`" in server.file(repo_id, "README.md").decode()
    assert sorted(server.recorded.created) == ["org/tiny-fp8", "org/tiny-fp8-block"]


@pytest.fixture
def in_process(server, tmp_path, monkeypatch):
    """The hub library in this process pointed at the push server (it reads its settings at import), Xet off."""
    from huggingface_hub import constants

    point_at(monkeypatch, server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setenv("HF_TOKEN", "write-token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return monkeypatch


def test_pushing_the_same_artifacts_again_uploads_nothing(cli, server, dist, in_process):
    out, _, _ = dist
    commits = {repo: len(r.commits) for repo, r in server.recorded.repos.items()}
    uploads = len(server.recorded.uploads)
    result = cli("push", out, "org/tiny-{name}")
    assert result.exit_code == 0, result.output
    assert {repo: len(r.commits) for repo, r in server.recorded.repos.items()} == commits
    assert len(server.recorded.uploads) == uploads
    head = server.recorded.repos["org/tiny-fp8"].head
    assert f"pushed fp8: {server.endpoint}/org/tiny-fp8/commit/{head}" in result.stdout


def test_several_targets_into_one_repos_subfolders(cli, server, dist, in_process):
    out, _, _ = dist
    uploads = len(server.recorded.uploads)
    result = cli("push", out, "org/tiny-quantized", "--subfolders", "--private")
    assert result.exit_code == 0, result.output
    repo = server.recorded.repos["org/tiny-quantized"]
    assert repo.private and len(repo.commits) == 1
    assert repo.commits[0]["summary"] == "quantkit: fp8 (fp8) gate PASS; fp8-block (fp8) gate PASS"
    assert {"README.md", "fp8/README.md", "fp8/model.safetensors", "fp8-block/model.safetensors"} <= set(repo.files)
    root = server.file("org/tiny-quantized", "README.md").decode()
    assert "[fp8](fp8/README.md)" in root and "[fp8-block](fp8-block/README.md)" in root
    assert len(server.recorded.uploads) == uploads  # the same weights were uploaded before: nothing new


def refused(result, out: Path | None = None) -> str:
    assert result.exit_code == 2, result.output
    if out is not None:
        assert leftovers(out.parent, out.name) == []
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("· ")]  # not the progress
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].strip().startswith("hint: "), lines
    return lines[0]


def test_a_read_only_token_is_refused_before_any_work(cli, server, micro_model, tmp_path, in_process):
    in_process.setenv("HF_TOKEN", "read-token")
    out = tmp_path / "out"
    line = refused(cli("quantize", micro_model, "--method", "fp8", "-o", out, "--push-to-hub", "org/ro"), out)
    assert "read-only" in line and "org/ro" not in server.recorded.repos


def test_no_token_and_offline_are_refused_before_any_work(cli, server, micro_model, tmp_path, in_process):
    out = tmp_path / "out"
    line = refused(cli("quantize", micro_model, "--method", "fp8", "-o", out, "--push-to-hub", "org/x", "--offline"),
                   out)
    assert "needs the network" in line
    in_process.delenv("HF_TOKEN")
    line = refused(cli("quantize", micro_model, "--method", "fp8", "-o", out, "--push-to-hub", "org/x"), out)
    assert "needs a Hugging Face token" in line


def test_a_namespace_the_token_cannot_write_leaves_no_repo(cli, server, dist, in_process):
    in_process.setenv("HF_TOKEN", "stranger-token")
    line = refused(cli("push", dist[0] / "fp8", "org/elsewhere"))
    assert "the Hugging Face token cannot write to org/elsewhere (HTTP 403)" in line
    assert "org/elsewhere" not in server.recorded.repos and "org/elsewhere" not in server.recorded.created


def test_a_refused_commit_deletes_the_repo_it_created(cli, server, dist, in_process):
    server.refuse_commits = True
    try:
        line = refused(cli("push", dist[0] / "fp8", "org/blocked"))
    finally:
        server.refuse_commits = False
    assert "cannot write to org/blocked" in line
    assert "org/blocked" in server.recorded.created and "org/blocked" in server.recorded.deleted
    assert "org/blocked" not in server.recorded.repos


def test_only_an_artifact_that_passed_is_pushed(cli, server, dist, tmp_path, in_process):
    failed = shutil.copytree(dist[0] / "fp8", tmp_path / "failed")
    record = json.loads((failed / "quantkit.json").read_text())
    record["targets"][0]["gate"]["passed"] = False  # as a --no-gate run records a failed gate
    (failed / "quantkit.json").write_text(json.dumps(record))
    assert "fp8 did not pass its gate (FAIL)" in refused(cli("push", failed, "org/failed"))
    assert "2 targets would push to the same repo org/one-repo" in refused(cli("push", dist[0], "org/one-repo"))
    assert "org/one-repo" not in server.recorded.repos
    assert "org/failed" not in server.recorded.repos


@pytest.mark.slow
def test_a_run_that_fails_its_gate_pushes_nothing(server, micro_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(micro_model), "--method", "fp8",
                           "-o", str(tmp_path / "out"), "--push-to-hub", "org/gate-failed", *FAST_CALIB,
                           "--max-kld", "1e-12"], env=hub_env(server, tmp_path / "hf"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 3, proc.stderr
    assert "org/gate-failed" not in server.recorded.repos and "org/gate-failed" not in server.recorded.created


def test_a_gated_or_private_model_is_refused_with_the_token_hint(cli, server, tmp_path, in_process):
    """Reading a model: the server answers a gated repo 403 GatedRepo and a private one, without a token, 404
    RepoNotFound, as the Hub does."""
    from tests.hub_server import Repo

    server.recorded.gated.add("org/gated")
    server.recorded.repos["org/private"] = Repo(private=True)
    out = tmp_path / "out"
    line = refused(cli("quantize", "org/gated", "--method", "fp8", "-o", out), out)
    assert "access to the gated model org/gated was refused (HTTP 403)" in line
    in_process.delenv("HF_TOKEN")
    line = refused(cli("quantize", "org/private", "--method", "fp8", "-o", out), out)
    assert "has no model org/private (or it is private and the token cannot read it)" in line
