import pytest

from quantkit.errors import RecipeError
from quantkit.run.recipe import bundled_recipes_dir, load_recipe, target_gate, target_options, validate


def fp8_target(**extra):
    return {"name": "fp8", "method": "fp8", **extra}


def test_minimal_recipe_gets_defaults():
    recipe = validate({"targets": [fp8_target()]})
    assert recipe.calibration.source == "default"
    assert recipe.targets[0].options == {}


def test_unknown_top_level_key_names_the_field():
    with pytest.raises(RecipeError, match=r"calibartion: unknown field"):
        validate({"targets": [fp8_target()], "calibartion": {}})


def test_wrong_type_names_the_path():
    with pytest.raises(RecipeError, match=r"calibration\.num_samples"):
        validate({"targets": [fp8_target()], "calibration": {"num_samples": "many"}})


def test_unknown_method_lists_allowed_values():
    with pytest.raises(RecipeError, match=r"targets\.0\.method.*allowed: fp8, gptq"):
        validate({"targets": [{"name": "x", "method": "magic"}]})


def test_method_options_are_validated_with_path():
    with pytest.raises(RecipeError, match=r"targets\.0\.options\.scheme"):
        validate({"targets": [fp8_target(options={"scheme": "fp8-weird"})]})
    with pytest.raises(RecipeError, match=r"targets\.0\.options\.schema: unknown field"):
        validate({"targets": [fp8_target(options={"schema": "fp8-static"})]})


def test_duplicate_target_names_rejected():
    with pytest.raises(RecipeError, match="repeated: fp8"):
        validate({"targets": [fp8_target(), fp8_target()]})


def test_bad_ignore_regex_rejected():
    with pytest.raises(RecipeError, match="bad regex"):
        validate({"targets": [fp8_target(ignore=["re:(unclosed"])]})


def test_gate_layers_method_default_then_recipe_then_target():
    recipe = validate({"targets": [fp8_target(gate={"min_top1": 0.5})], "gate": {"max_kld": 0.3}})
    gate = target_gate(recipe, recipe.targets[0])
    assert gate.min_top1 == 0.5 and gate.max_kld == 0.3
    assert gate.max_ppl_increase == 0.02  # fp8 default


def test_every_bundled_recipe_validates():
    paths = sorted(bundled_recipes_dir().glob("*.yaml"))
    assert paths
    for path in paths:
        load_recipe(path)


def test_missing_and_non_mapping_files(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(bad)


def test_gguf_default_gate_depends_on_the_type():
    q8 = validate({"targets": [{"name": "a", "method": "gguf", "options": {"gguf_type": "Q8_0"}}]})
    q2 = validate({"targets": [{"name": "a", "method": "gguf", "options": {"gguf_type": "Q2_K"}}]})
    assert target_gate(q8, q8.targets[0]).max_kld < target_gate(q2, q2.targets[0]).max_kld


def test_bundled_recipes_found_from_package_data(tmp_path, monkeypatch):
    """A regular (non-editable) install has no recipes/ beside the package: the wheel's
    quantkit/_recipes is used instead."""
    import shutil
    from pathlib import Path

    import quantkit

    package = tmp_path / "site" / "quantkit"
    shutil.copytree(Path(quantkit.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(bundled_recipes_dir(), package / "_recipes")
    monkeypatch.setattr("importlib.resources.files", lambda name: package)
    assert bundled_recipes_dir() == package / "_recipes"
    from quantkit.run.recipe import find_recipe

    assert find_recipe("fp8-dynamic") == package / "_recipes" / "fp8-dynamic.yaml"


def test_overrides_merge_into_recipe_data():
    from quantkit.run.recipe import Overrides, build_recipe

    overrides = Overrides(model="m", calibration={"seq_len": 64, "source": None}, gate={"max_kld": 0.5},
                          method_options={"scheme": "fp8-static", "bits": None}, ignore=["re:.*q_proj"])
    recipe = build_recipe("fp8-dynamic", None, overrides)
    assert recipe.model == "m" and recipe.calibration.seq_len == 64 and recipe.calibration.source == "default"
    assert recipe.gate.max_kld == 0.5 and recipe.targets[0].options["scheme"] == "fp8-static"
    assert recipe.targets[0].ignore == ["re:.*q_proj"]


def test_method_flag_that_no_target_has_is_an_error():
    from quantkit.errors import InputError
    from quantkit.run.recipe import Overrides, build_recipe

    with pytest.raises(InputError, match="--gguf-type does not apply to method fp8"):
        build_recipe(None, "fp8", Overrides(model="m", method_options={"gguf_type": "Q4_K_M"}))


def test_every_method_flag_is_an_option_of_some_method():
    """MethodOptions.given() names fields of the methods' own Options models, each taken by at least one
    method: a flag cannot drift from the options it sets."""
    from dataclasses import fields

    from quantkit.methods import METHODS, get_method
    from quantkit.run.recipe import MethodOptions

    options = {name for m in METHODS for name in get_method(m).options.model_fields}
    every = MethodOptions(**{f.name: (True if f.type in ("bool", bool) else "1") for f in fields(MethodOptions)
                             if f.name not in ("max_size",)}, max_size="+1%")
    assert set(every.given()) <= options
    assert {"auto_precision", "fallback", "group_size", "rotate", "kv_cache"} <= set(every.given())


def test_method_options_are_validated_once_per_target():
    """target_options returns the Options object validate() built; it does not validate the dict again."""
    recipe = validate({"targets": [{"name": "a", "method": "gptq", "options": {"group_size": 64}}]})
    first = target_options(recipe.targets[0])
    assert first is target_options(recipe.targets[0]) and first.group_size == 64


def test_a_size_limit_is_read_once():
    from quantkit.mixed.budget import Fallback

    relative, absolute = Fallback(max_size="+10%"), Fallback(max_size="120MB")
    assert relative.relative and relative.size_limit(1000) == 1100
    assert not absolute.relative and absolute.size_limit(1) == 120_000_000 and absolute.model_dump()["max_size"] == "120MB"


def test_gate_overrides_never_change_the_method_defaults():
    """A run's --max-kld must not leak into the next run in the same process (gguf's table)."""
    q2 = validate({"targets": [{"name": "a", "method": "gguf", "options": {"gguf_type": "Q2_K"}}],
                   "gate": {"max_kld": 0.000001}})
    assert target_gate(q2, q2.targets[0]).max_kld == 0.000001
    fresh = validate({"targets": [{"name": "a", "method": "gguf", "options": {"gguf_type": "Q2_K"}}]})
    assert target_gate(fresh, fresh.targets[0]).max_kld == 0.40


def test_four_bit_towers_need_force_in_the_recipe():
    data = {"model": "m", "targets": [{"name": "t", "method": "gptq", "projector": "int4"}]}
    with pytest.raises(RecipeError, match=r"targets\.0.*projector: int4 refused.*force: true"):
        validate(data)
    target = validate({**data, "targets": [{**data["targets"][0], "force": True}]}).targets[0]
    assert target.tower_precision() == {"projector": "int4"}
    with pytest.raises(RecipeError, match=r"targets\.0\.vision"):
        validate({"model": "m", "targets": [{"name": "t", "method": "gptq", "vision": "int2"}]})
