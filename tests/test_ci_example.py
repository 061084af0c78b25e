"""examples/ci/: the shell script runs as written against the tiny demo model plus a LoRA adapter,
and the GitHub Actions workflow calls it with a cache that keeps --skip-existing's outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.util import REPO, subprocess_env

SCRIPT = REPO / "examples" / "ci" / "requantize.sh"
WORKFLOW = REPO / "examples" / "ci" / "quantize.yml"
# small windows so the release recipe (FP8 + AWQ + GGUF Q4_K_M) runs in a minute or two on a CPU;
# the toy model is barely trained, so top-1 agreement flips on near-ties
FAST = ("--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--min-top1", "0.5")


def make_adapter(model_dir, out, seed: int):
    """A LoRA adapter on q/v projections with non-zero B (merging changes the model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    model.save_pretrained(out)
    return out


def test_workflow_runs_the_script_with_a_dist_cache():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["quantize"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert any("examples/ci/requantize.sh" in r for r in runs)
    restore = next(s for s in steps if s.get("uses", "").startswith("actions/cache/restore"))
    save = next(s for s in steps if s.get("uses", "").startswith("actions/cache/save"))
    assert restore["with"]["path"] == save["with"]["path"] == "${{ env.OUT }}"
    assert restore["with"]["restore-keys"]  # falls back to an older dist: --skip-existing decides per target
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)
    assert workflow["env"]["RECIPE"] == "release"


@pytest.mark.slow
def test_requantize_script_end_to_end(micro_model, tmp_path):
    adapter = make_adapter(micro_model, tmp_path / "adapter", seed=0)
    summary = tmp_path / "summary.md"
    env = subprocess_env(MODEL=str(micro_model), ADAPTER=str(adapter), OUT=str(tmp_path / "dist"),
                         REPORT=str(tmp_path / "report.json"), SUMMARY=str(summary),
                         QUANTKIT=f"{sys.executable} -m quantkit")
    env.pop("GITHUB_STEP_SUMMARY", None)

    def requantize(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *FAST, *extra], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=1800)

    def statuses() -> dict[str, str]:
        return {t["name"]: t["status"] for t in json.loads((tmp_path / "report.json").read_text())["targets"]}

    first = requantize()
    assert first.returncode == 0, first.stdout + first.stderr
    assert statuses() == {"fp8-dynamic": "passed", "w4a16-awq": "passed", "gguf-q4_k_m": "passed"}
    dist = tmp_path / "dist"
    assert (dist / "fp8-dynamic" / "model.safetensors").is_file() and (dist / "w4a16-awq" / "model.safetensors").is_file()
    assert len(list((dist / "gguf-q4_k_m").glob("*.gguf"))) == 1
    assert "| fp8-dynamic | fp8 | passed |" in summary.read_text()
    assert first.stdout.count(": PASS;") == 3  # --quiet: one line per target, then the script's line

    second = requantize()  # nothing changed: every target is skipped
    assert second.returncode == 0, second.stdout + second.stderr
    assert set(statuses().values()) == {"skipped"}

    make_adapter(micro_model, adapter, seed=1)  # a new fine-tune; the FP8 target's gate cannot pass
    third = requantize("--only", "fp8-dynamic", "--max-kld", "0")
    assert third.returncode == 3, third.stdout + third.stderr
    assert statuses() == {"fp8-dynamic": "failed"}
    assert "a quality gate failed" in third.stderr
    assert "| fp8-dynamic | fp8 | FAILED |" in summary.read_text().split("### quantkit")[-1]
