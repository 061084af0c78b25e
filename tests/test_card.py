"""The model card's parts that need no run: the front matter the Hub reads, the Hub run command per artifact
kind, the base's license, the figure's axis, and the recipe's `push:` rules."""

from __future__ import annotations

import math

import pytest
import yaml

from quantkit.errors import InputError, RecipeError
from quantkit.run.card import Place, front_matter, hub_command, model_card, read_license, repo_card
from quantkit.run.report import ModelReport, RunReport, TargetReport


def report(hub: dict | None = None, towers: dict | None = None) -> RunReport:
    model = ModelReport(path="/machine/ckpt", architecture="LlamaForCausalLM", model_type="llama", parameters=1,
                        dtype="BF16", sha256={}, towers=towers, hub=hub, license={"license": "other",
                                                                                  "license_name": "llama3"})
    return RunReport(quantkit_version="0.1.0", versions={}, model=model, calibration={}, gate_enforced=True,
                     recipe={"model": "/machine/ckpt", "targets": [{"name": "q4", "method": "gguf"}]},
                     inputs={"model/config.json": "c0ffee"})


def target(method: str = "gguf", files: tuple[str, ...] = ("mmproj-x.gguf", "tiny-Q4_K_M.gguf")) -> TargetReport:
    return TargetReport(name="q4", method=method, format="GGUF Q4_K_M", engine="quantkit", engine_version=None,
                        options={}, ignore=[], kept=[], quantized_modules=1, files=list(files),
                        details={"serving": {"serve": "vllm serve .", "devices": {}, "weights_bytes": 1,
                                             "kv_cache_bytes": 1, "context": 4096}})


HUB = {"repo_id": "org/base", "revision": "main", "sha": "a" * 40, "endpoint": "https://huggingface.co", "files": {}}


def test_the_front_matter_names_the_hub_base_and_never_a_local_path():
    front = front_matter(target(), report(HUB))
    assert front["base_model"] == "org/base" and front["base_model_relation"] == "quantized"
    assert front["library_name"] == "gguf" and front["pipeline_tag"] == "text-generation"
    assert (front["license"], front["license_name"]) == ("other", "llama3")
    local = model_card(target(), report())
    assert "base_model" not in yaml.safe_load(local.split("---")[1]) and "/machine/ckpt" not in local
    assert "from a local checkpoint (config.json sha256 `c0ffee`)" in local
    assert front_matter(target(), report(HUB, towers={"vision": ["v"]}))["pipeline_tag"] == "image-text-to-text"


def test_the_hub_command_per_artifact_kind():
    assert hub_command(target(), Place("org/q")) == "llama-server --hf-repo org/q --hf-file tiny-Q4_K_M.gguf"
    assert hub_command(target(), Place("org/q", "q4")).endswith("--hf-file q4/tiny-Q4_K_M.gguf")
    fp8 = target("fp8")
    assert hub_command(fp8, Place("org/q")) == "vllm serve org/q"
    assert hub_command(fp8, Place("org/q", "q4")) == "hf download org/q --include 'q4/*' --local-dir . && vllm serve ./q4"
    fp8.details["serving"]["serve"] = 'mlx_lm.generate --model . --prompt "Hello" (or: mlx_lm.server --model .)'
    assert hub_command(fp8, Place("org/q")).count("--model org/q") == 2


def test_the_root_card_of_a_repo_with_subfolders_lists_each_target():
    card = repo_card([(target(), report(HUB)), (target("fp8"), report(HUB))], "org/q")
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "org/base" and "quantization" not in front
    assert card.count("](q4/README.md)") == 2 and "not measured" in card


def test_the_license_comes_from_the_bases_own_card(tmp_path):
    assert read_license(tmp_path) is None
    (tmp_path / "README.md").write_text("---\nlicense: other\nlicense_name: llama3\nlicense_link: LICENSE\n---\n# x\n")
    assert read_license(tmp_path) == {"license": "other", "license_name": "llama3", "license_link": "LICENSE"}
    (tmp_path / "README.md").write_text("# a card without front matter\n")
    assert read_license(tmp_path) is None


def test_the_figure_places_values_between_the_bin_edges():
    from quantkit.eval.evaluate import KLD_EDGES
    from quantkit.run.figure import position

    assert position(KLD_EDGES[0], KLD_EDGES) == 0.5 and position(KLD_EDGES[3], KLD_EDGES) == pytest.approx(3.5)
    assert position(math.sqrt(KLD_EDGES[3] * KLD_EDGES[4]), KLD_EDGES) == pytest.approx(4.0)  # log-midpoint
    assert position(0.0, KLD_EDGES) == -0.5 and position(1e9, KLD_EDGES) == len(KLD_EDGES) - 0.5


def test_the_kld_histogram_counts_every_finite_position():
    from quantkit.eval.evaluate import KLD_EDGES, kld_histogram

    counts = kld_histogram([0.0, 2e-6, 5e-3, 50.0, float("nan")])
    assert len(counts) == len(KLD_EDGES) + 1 and sum(counts) == 4
    assert counts[0] == 1 and counts[1] == 1 and counts[-1] == 1


def test_push_in_a_recipe_and_on_the_command_line():
    from quantkit.run.recipe import Overrides, build_recipe, push_places

    two = "release"
    recipe = build_recipe(two, None, Overrides(model="org/base", push={"repo": "me/base-{name}", "private": True}))
    assert recipe.push.private and set(push_places(recipe).values()) == {
        (f"me/base-{t.name}", None) for t in recipe.targets}
    with pytest.raises(RecipeError, match="would push to the same repo me/base"):
        build_recipe(two, None, Overrides(model="org/base", push={"repo": "me/base"}))
    with pytest.raises(RecipeError, match="only placeholder"):
        build_recipe(two, None, Overrides(model="org/base", push={"repo": "me/{model}"}))
    with pytest.raises(InputError, match="--private sets the visibility"):
        build_recipe("fp8-dynamic", None, Overrides(model="org/base", push={"private": True}))
    assert build_recipe("fp8-dynamic", None, Overrides(model="org/base", offline=True)).offline
