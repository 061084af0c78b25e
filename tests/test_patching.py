"""quantkit.engines.patching: module functions and class methods swapped while inside, restored after."""

import pytest

from quantkit.engines.patching import site_function, site_owner, swapped


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
