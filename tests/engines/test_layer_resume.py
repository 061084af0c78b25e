"""quantkit.engines.llmcompressor.layer_resume without a run: what saved layers are resumed from, and what is set
aside (tests/cli/test_resume.py kills and resumes real runs)."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.engines.llmcompressor import layer_resume as lr
from quantkit.engines.llmcompressor.model_free import file_sha256
from quantkit.io.export import replace_json


@dataclass
class Subgraph:
    input_names: set


SUBGRAPHS = [Subgraph({"input_ids"}), Subgraph({"hidden", "rotary"}), Subgraph({"hidden", "rotary"})]


def saved(tmp_path, layers: int = 2):
    """A directory as save_layer leaves it after `layers` layers: their files, the last hidden states, the record."""
    names = [lr.layer_file(i) for i in range(layers)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"layer %d" % i)
    (tmp_path / lr.activations_file(layers - 1)).write_bytes(b"hidden")
    replace_json(tmp_path / lr.STATE_FILE, {"version": lr.STATE_VERSION, "partition": lr.partition(SUBGRAPHS),
                                            "layers": [file_sha256(tmp_path / n) for n in names],
                                            "activations": file_sha256(tmp_path / lr.activations_file(layers - 1))})
    return lr.read_state(tmp_path)


def test_saved_layers_that_verify_are_resumed_from(tmp_path):
    assert lr.unusable(tmp_path, saved(tmp_path), SUBGRAPHS) is None


def test_a_torn_or_missing_file_is_named(tmp_path):
    state = saved(tmp_path)
    (tmp_path / lr.layer_file(1)).write_bytes(b"layer")
    assert lr.unusable(tmp_path, state, SUBGRAPHS) == "layer-00001.safetensors does not verify (sha256)"
    (tmp_path / lr.activations_file(1)).unlink()
    state = saved(tmp_path)
    (tmp_path / lr.activations_file(1)).unlink()
    assert lr.unusable(tmp_path, state, SUBGRAPHS) == "activations-00001.pt does not verify (sha256)"


def test_another_partition_or_count_is_not_resumed(tmp_path):
    state = saved(tmp_path)
    assert lr.unusable(tmp_path, state, SUBGRAPHS[:2] + [Subgraph({"other"})]) == (
        "the model splits into other subgraphs than the saved progress's")
    assert lr.unusable(tmp_path, saved(tmp_path, 3), SUBGRAPHS) == "3 saved layers for 3 subgraphs"


def test_progress_that_is_not_usable_starts_from_the_first_layer_and_says_why(tmp_path):
    saved(tmp_path)
    (tmp_path / lr.layer_file(0)).write_bytes(b"torn")
    said = []
    first, cache = lr.resume_point(lr.LayerCheckpoints(tmp_path, said.append), None, SUBGRAPHS, "fresh cache")
    assert (first, cache) == (0, "fresh cache")
    assert said == ["warning: --resume: the saved layers are not used (layer-00000.safetensors does not verify "
                    "(sha256)); starting from the first"]


def test_no_saved_progress_or_no_resume_starts_at_the_first_layer(tmp_path):
    assert lr.resume_point(lr.LayerCheckpoints(tmp_path, print), None, SUBGRAPHS, "c") == (0, "c")
    assert lr.resume_point(None, None, SUBGRAPHS, "c") == (0, "c")
    (tmp_path / lr.STATE_FILE).write_text('{"version": 0}')  # another format of the record
    assert lr.read_state(tmp_path) is None


def test_the_searches_and_rotations_do_not_resume():
    from quantkit.methods import get_method

    gptq = get_method("gptq")
    assert gptq.resume.refused(None, gptq.options()) is None
    assert "search" in gptq.resume.refused(None, gptq.options(fallback={}))
    assert "rotation" in gptq.resume.refused(None, gptq.options(rotate="spinquant"))
    nvfp4 = get_method("nvfp4")
    assert "calibrates nothing" in nvfp4.resume.refused(None, nvfp4.options(scheme="a16"))


def test_each_rank_checks_its_own_hidden_states_and_rank_0_the_layers(tmp_path):
    """Under torchrun each rank saved its own hidden states; the record names every rank's and the world size."""
    from quantkit.engines.llmcompressor.distributed import Ranks

    state = saved(tmp_path)
    ranks = [Ranks(rank, 2) for rank in range(2)]
    for ranks_one in ranks:
        (tmp_path / lr.activations_file(1, ranks_one)).write_bytes(b"hidden %d" % ranks_one.rank)
    state = {**state, "world_size": 2,
             "activations": [file_sha256(tmp_path / lr.activations_file(1, r)) for r in ranks]}
    assert [lr.unusable(tmp_path, state, SUBGRAPHS, r) for r in ranks] == [None, None]
    (tmp_path / lr.layer_file(0)).write_bytes(b"torn")  # rank 0 reads the layers, rank 1 only its hidden states
    assert [lr.unusable(tmp_path, state, SUBGRAPHS, r) for r in ranks] == [
        "layer-00000.safetensors does not verify (sha256)", None]
    (tmp_path / lr.activations_file(1, ranks[1])).write_bytes(b"torn")
    assert lr.unusable(tmp_path, state, SUBGRAPHS, ranks[1]) == "activations-00001-rank1.pt does not verify (sha256)"
    assert lr.unusable(tmp_path, state, SUBGRAPHS) == "it was saved by 2 ranks, and this launch has 1"
