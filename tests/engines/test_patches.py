"""quantkit.engines.patches: the inventory of run-time patches (every site exists, takes what its
replacement takes, is guarded by its versions), and the swap mechanism (module functions and class
methods swapped while inside, restored after)."""

import pytest

from quantkit.engines.patches import (
    PATCHES,
    Patch,
    check_version,
    patched,
    signature_matches,
    site_function,
    site_owner,
    swapped,
)
from quantkit.errors import InternalError


@pytest.mark.parametrize("name", list(PATCHES))
def test_every_site_exists_and_takes_what_its_replacement_takes(name):
    from importlib.metadata import version

    from packaging.specifiers import SpecifierSet

    patch = PATCHES[name]
    assert site_function(patch.site) is not None, name  # raises when the site is gone
    assert signature_matches(patch), name
    assert version(patch.package) in SpecifierSet(patch.verified), name  # the pinned engines
    assert patch.why


@pytest.mark.parametrize("name", list(PATCHES))
def test_every_patch_is_swapped_in_and_restored(name):
    site = PATCHES[name].site
    original = site_function(site)
    with patched(name):
        assert site_function(site) is not original
    assert site_function(site) is original


def test_a_package_outside_the_verified_versions_is_refused_before_anything_is_swapped():
    patch = Patch(("json", "dumps"), "pydantic", "==0.0.1", "json:loads", "a test")
    with pytest.raises(InternalError, match="verified against pydantic==0.0.1"):
        check_version("test", patch)


def helper() -> str:
    return "original"


class Holder:
    def method(self) -> str:
        return "original"


def test_a_module_function_and_a_method_are_swapped_and_restored():
    sites = {(__name__, "helper"): lambda: "swapped", (__name__, "Holder.method"): lambda self: "swapped"}
    with swapped(sites):
        assert globals()["helper"]() == "swapped" and Holder().method() == "swapped"
    assert helper() == "original" and Holder().method() == "original"
    assert site_owner((__name__, "Holder.method")) == (Holder, "method")


def test_the_original_is_restored_when_the_body_raises():
    with pytest.raises(ValueError), swapped({(__name__, "Holder.method"): lambda self: "swapped"}):
        raise ValueError
    assert Holder().method() == "original"


@pytest.mark.parametrize("site", [(__name__, "gone"), (__name__, "Holder.gone"), (__name__, "Gone.method")])
def test_a_site_that_is_gone_raises_before_anything_is_swapped(site):
    with pytest.raises(AttributeError, match="no longer exists"):
        site_function(site)
    with pytest.raises(AttributeError), swapped({(__name__, "helper"): lambda: "swapped", site: lambda: None}):
        pass
    assert helper() == "original"


def autoround_asymmetric_layer(bits: int, group: int = 8):
    """A weight on AutoRound's asymmetric grid: unsigned levels 0..2^bits-1 minus a zero point per group."""
    import torch

    gen = torch.Generator().manual_seed(0)
    rows, groups, top = 6, 4, 2**bits - 1
    scale = torch.rand(rows, groups, generator=gen) + 0.1
    zero_point = torch.randint(0, top + 1, (rows, groups), generator=gen).float()
    levels = torch.randint(0, top + 1, (rows, groups, group), generator=gen).float()
    levels[0, 0, 0], levels[0, 0, 1] = 0, top  # both ends of the grid are used
    weight = ((levels - zero_point.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(rows, groups * group)
    return weight, scale, zero_point


@pytest.mark.parametrize("bits", [4, 8])
def test_autoround_zero_points_reproduce_its_weights_in_compressed_tensors(bits):
    """AutoRound's unsigned zero points, moved to the signed grid, make compressed-tensors' own rounding
    give back exactly the weight AutoRound tuned (zero points of 0 would clamp it)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    from quantkit.engines.patches import signed_zero_points

    weight, scale, zero_point = autoround_asymmetric_layer(bits)
    signed = signed_zero_points(weight, scale, zero_point, bits)
    assert signed.min() >= -(2 ** (bits - 1)) and signed.max() <= 2 ** (bits - 1) - 1
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=8)
    assert torch.equal(fake_quantize(weight, scale, signed, args), weight)
    assert not torch.equal(fake_quantize(weight, scale, torch.zeros_like(signed), args), weight)


def test_a_weight_off_the_grid_the_conversion_knows_is_refused():
    from quantkit.engines.patches import signed_zero_points

    weight, scale, zero_point = autoround_asymmetric_layer(4)
    with pytest.raises(InternalError, match="q_proj with 4-bit levels from .* outside compressed-tensors' -8..7"):
        signed_zero_points(weight, scale, zero_point + 3, 4, "q_proj")


# a whole run in a subprocess; the patch's mechanism fast: test_a_patch_on_import_waits_for_its_trigger
@pytest.mark.slow
def test_a_quantize_run_never_imports_scikit_learn(micro_model, tmp_path):
    """lm-eval installs scikit-learn; transformers would import it (with scipy and pandas) in every run."""
    import subprocess
    import sys

    from tests.util import FAST_CALIB, subprocess_env

    code = ("import sys\nfrom quantkit.cli.app import app\n"
            "try:\n    app(sys.argv[1:], standalone_mode=False)\nfinally:\n"
            "    print('sklearn imported:', 'sklearn' in sys.modules, 'model class:', 'transformers.generation' in sys.modules)")
    args = ["quantize", str(micro_model), "--method", "fp8", "-o", str(tmp_path / "out"), *FAST_CALIB, "--no-gate"]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sklearn imported: False model class: True" in done.stdout


def test_a_patch_on_import_waits_for_its_trigger(monkeypatch):
    """patched_on_import swaps nothing until the trigger module is about to be imported, then swaps, and
    restores on exit."""
    import sys

    import transformers.utils

    from quantkit.engines.patches import patched_on_import, sklearn_absent

    monkeypatch.delitem(sys.modules, "wsgiref.simple_server", raising=False)
    original = transformers.utils.is_sklearn_available
    with patched_on_import("transformers.sklearn", "wsgiref.simple_server"):
        assert transformers.utils.is_sklearn_available is original
        import wsgiref.simple_server  # noqa: F401  the trigger

        assert transformers.utils.is_sklearn_available is sklearn_absent
    assert transformers.utils.is_sklearn_available is original
    assert not any(type(f).__name__ == "ImportTrigger" for f in sys.meta_path)
