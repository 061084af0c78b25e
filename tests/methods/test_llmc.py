"""quantkit.engines.llmcompressor.llmc: the glue around llm-compressor's oneshot."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from quantkit.engines.llmcompressor import llmc
from quantkit.engines.patches import PATCHES, site_function, weights_per_forward
from quantkit.engines.transformers import Offload


def job(offload: Offload | None, device: str) -> SimpleNamespace:
    return SimpleNamespace(offload=offload, device=device)


@pytest.mark.parametrize("offload, device, expected", [
    (Offload(Path("o"), layers=True), "cpu", True),
    (Offload(Path("o"), layers=True), "cuda", False),  # a GPU keeps a subgraph onloaded: no copy per batch
    (Offload(Path("o"), layers=False), "cpu", False),  # the default: decoder layers in RAM
    (None, "cpu", False),
])
def test_layers_are_read_per_forward_only_from_disk_on_a_cpu(offload, device, expected):
    assert llmc.reads_layers_per_forward(job(offload, device)) is expected


def test_the_pipeline_holds_no_subgraph_onloaded_inside_and_is_restored_after():
    original = site_function(PATCHES["sequential.disable_offloading"].site)
    on_disk = job(Offload(Path("o"), layers=True), "cpu")
    with llmc.onloaded_per_forward(on_disk, reads_weights_only=True):
        assert site_function(PATCHES["sequential.disable_offloading"].site) is weights_per_forward
    assert site_function(PATCHES["sequential.disable_offloading"].site) is original
    with llmc.onloaded_per_forward(job(None, "cpu"), reads_weights_only=True):
        assert site_function(PATCHES["sequential.disable_offloading"].site) is original
    # AWQ's grid search writes trial scales into the onloaded weights: they must stay onloaded
    with llmc.onloaded_per_forward(on_disk, reads_weights_only=False):
        assert site_function(PATCHES["sequential.disable_offloading"].site) is original
