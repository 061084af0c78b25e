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
