"""quantkit.io.memory: the collector kept off the objects that outlive a phase."""

import gc
import weakref

import pytest

from quantkit.io.memory import collector_skips_existing_objects


class Cycle:
    def __init__(self):
        self.me = self


def test_objects_from_before_are_frozen_and_new_ones_are_not():
    with collector_skips_existing_objects():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        new = Cycle()
        assert gc.get_freeze_count() == frozen  # made inside: the collector still sees it
        del new
        assert gc.collect() > 0  # the new cycle is collected inside
    assert gc.get_freeze_count() == 0


def test_unfrozen_when_the_body_raises():
    with pytest.raises(RuntimeError), collector_skips_existing_objects():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_frozen_cycle_is_collected_after_the_exit():
    cycle = Cycle()
    alive = weakref.ref(cycle)
    with collector_skips_existing_objects():
        del cycle
        gc.collect()
        assert alive() is not None  # frozen: the collector leaves it
    gc.collect()
    assert alive() is None
