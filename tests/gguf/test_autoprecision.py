"""Mixed precision for GGUF: the sensitivity table, --auto-precision under the mixture's size, the
gate-driven --fallback, and llama-quantize --tensor-type reproducing the chosen types."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantkit.gguf.mixture import T
from quantkit.mixed import budget as mixed
from quantkit.mixed import gguf as budget
from quantkit.mixed.gguf import candidates, table_row

CALIB = ("--num-samples", "4", "--seq-len", "64", "--eval-windows", "4")


def row(name: str, scale: float, shape=(256, 256), mixture: str = "Q4_K"):
    """A table row whose error falls by 4 per bit of its candidate types (roughly what the quants do)."""
    from quantkit.mixed.gguf import bits_per_weight

    errors = {t.name: scale * 4.0 ** -bits_per_weight(t) for t in candidates(shape[-1])}
    return table_row(name, shape, mixture, errors)


def test_candidates_are_what_llama_cpp_allows_for_the_row():
    from quantkit.gguf.mixture import IMATRIX_TYPES
    from quantkit.gguf.quants import SUPPORTED
    from quantkit.mixed.gguf import bits_per_weight

    classic = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q4_0, T.Q4_1, T.Q5_K, T.Q5_0, T.Q5_1, T.Q6_K, T.Q8_0]
    c512 = candidates(512)
    assert [t for t in c512 if t in classic] == classic
    assert c512.index(T.IQ4_XS) < c512.index(T.Q4_K) < c512.index(T.IQ4_NL)  # 4.25 bpw; 4.5 bpw, 256 first
    assert [bits_per_weight(t) for t in c512] == sorted(bits_per_weight(t) for t in c512)
    assert not set(c512) & set(IMATRIX_TYPES)  # those only with an imatrix
    assert set(candidates(512, imatrix=True)) == {t for t in SUPPORTED if t not in (T.F32, T.F16, T.BF16)}
    # llama.cpp's fallback types: the 32-value ones
    assert candidates(576) == candidates(576, imatrix=True) == [T.Q4_0, T.IQ4_NL, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
    assert candidates(100) == []  # F16: not budgeted


class Rows:
    """A source of one float32 matrix by rows (SafetensorsRows.read), counting the rows it hands out."""

    def __init__(self, matrix):
        self.matrix, self.read_rows = matrix, 0

    def read(self, name, start, stop):
        self.read_rows += stop - start
        return self.matrix[start:stop].copy()


def test_weighted_errors_come_from_a_sample_of_rows_scaled_to_the_matrix():
    import numpy as np

    from quantkit.gguf.convert import TensorPlan
    from quantkit.mixed.gguf import ERROR_ROWS, error_sample, tensor_errors, weighted_error

    rng = np.random.default_rng(0)
    matrix = rng.normal(size=(ERROR_ROWS * 4, 512)).astype(np.float32)
    matrix[::7] *= 20  # outlier rows carry most of the error
    importance = rng.uniform(0.5, 2.0, 512).astype(np.float32)
    index, _ = error_sample(Rows(matrix), "w", len(matrix), 512, importance, None)
    norms = (matrix * matrix * importance).sum(axis=1)
    assert len(index) == ERROR_ROWS and {int(norms.argmax()), int(norms.argmin())} <= set(index.tolist())
    errors = tensor_errors({"w": Rows(matrix)}, TensorPlan("blk.0.attn_q.weight", "w", matrix.shape, T.Q4_0), None,
                           importance, None, threads=2)
    for qtype in (T.Q4_0, T.Q8_0):
        whole = weighted_error(matrix, qtype, None, importance, None)
        assert errors[qtype.name] == pytest.approx(whole, rel=0.05)  # rows quantize on their own: a fair sample
    small = matrix[:ERROR_ROWS // 2]
    exact = tensor_errors({"w": Rows(small)}, TensorPlan("t", "w", small.shape, T.Q4_0), None, importance, None)
    assert exact["Q5_1"] == weighted_error(small, T.Q5_1, None, importance, None)  # every row: exact
    # token_embd's rows weighted by token frequency: the rows of weight 0 add nothing and are skipped, exactly
    frequencies = np.zeros(len(matrix), dtype=np.float32)
    frequencies[[3, 4, 5, 100]] = [0.5, 0.25, 0.125, 0.125]
    source = Rows(matrix)
    embedded = tensor_errors({"w": source}, TensorPlan("token_embd.weight", "w", matrix.shape, T.Q4_0), None, None,
                             frequencies)
    assert source.read_rows == 4  # those rows alone are read
    assert embedded["Q4_0"] == pytest.approx(weighted_error(matrix, T.Q4_0, None, None, frequencies), rel=1e-6)


def test_a_split_s_pieces_are_measured_and_patched_on_their_own_rows():
    """A tensor the conversion cuts into row blocks as stored (Granite 4's shared MLP input_linear into ffn_gate and
    ffn_up): each piece's weighted errors are its rows', and its probe patches those rows of the source matrix alone;
    a whole type map quantizes each piece at its own type."""
    import numpy as np

    from quantkit.gguf.convert import TensorPlan
    from quantkit.gguf.quants import dequantize, quantize
    from quantkit.mixed.gguf import TypedMatrices, quantized_matrices, tensor_errors, weighted_error

    rng = np.random.default_rng(1)
    matrix = rng.normal(size=(64, 256)).astype(np.float32)
    matrix[32:] *= 10  # the up half: ten times the gate half's error
    source = Rows(matrix)
    source.header = {"w": {"shape": list(matrix.shape)}}
    gate, up = (TensorPlan(f"blk.0.ffn_{n}.weight", "w", (32, 256), T.Q4_0, source_rows=(a, a + 32))
                for n, a in (("gate", 0), ("up", 32)))
    for plan, rows in ((gate, matrix[:32]), (up, matrix[32:])):
        errors = tensor_errors({"w": source}, plan, None, None, None)
        assert errors["Q4_0"] == weighted_error(rows, T.Q4_0, None, None, None)
    patched = quantized_matrices({"w": source}, up, T.Q4_0, None)["w"].numpy()
    assert np.array_equal(patched[:32], matrix[:32])
    assert np.array_equal(patched[32:], dequantize(quantize(matrix[32:], T.Q4_0), T.Q4_0))
    typed = TypedMatrices({"w": source}, [gate, up], {gate.name: T.Q8_0, up.name: T.Q4_0}, None)["w"].numpy()
    assert np.array_equal(typed[:32], dequantize(quantize(matrix[:32], T.Q8_0), T.Q8_0))
    assert np.array_equal(typed[32:], patched[32:])


def test_a_dominated_candidate_is_never_chosen():
    """Q4_0 is as large as Q4_K: with more error it leaves the tensor's choices; Q4_1 sits between sizes."""
    r = table_row("t", (256, 512), "Q4_K", {"Q2_K": 9.0, "Q3_K": 5.0, "Q4_0": 3.0, "Q4_K": 2.0, "Q4_1": 2.5,
                                             "Q5_0": 1.0, "Q5_K": 0.8, "Q5_1": 0.7, "Q6_K": 0.5, "Q8_0": 0.1})
    assert r.candidates == ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q5_1", "Q6_K", "Q8_0"]


def test_the_size_model_is_the_bytes_in_the_file():
    assert budget.nbytes((576, 576), T.Q4_0) == 576 * 576 // 32 * 18
    assert budget.nbytes((3, 32), T.Q4_0) == 64  # 54 bytes of blocks, padded to the 32-byte alignment


def test_assign_types_stays_within_budget_and_favours_damage():
    table = [row("a", 100.0), row("b", 1.0), row("c", 1.0), row("d", 1.0, shape=(256, 576), mixture="Q5_0")]
    mixture = budget.total_bytes(table, budget.mixture_types(table))
    types = budget.assign_types(table, mixture)
    assert budget.total_bytes(table, types) <= mixture
    assert types["a"] > types["b"] and types["b"] == types["c"]  # the sensitive tensor gets the bits
    assert types["d"] in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
    cheapest = budget.cheapest_bytes(table)
    assert budget.assign_types(table, cheapest) == {"a": T.Q2_K, "b": T.Q2_K, "c": T.Q2_K, "d": T.Q4_0}
    with pytest.raises(mixed.BudgetError, match=f"{cheapest - 1:,} bytes cannot be met.*{cheapest:,} bytes"):
        budget.assign_types(table, cheapest - 1)


def test_head_kept_limits_the_embedding_and_head_to_their_mixture_type_or_above():
    table = [row("token_embd.weight", 1.0, shape=(3001, 576), mixture="Q8_0"),
             row("output.weight", 1.0, mixture="Q6_K"), row("blk.0.ffn_down.weight", 1.0)]
    kept = {r.name: r.candidates for r in budget.head_kept(table)}
    assert kept["token_embd.weight"] == ["Q8_0"]
    assert kept["output.weight"] == ["Q6_K", "Q8_0"]
    assert kept["blk.0.ffn_down.weight"] == table[2].candidates  # the rest unchanged
    assert table[0].candidates[0] == "Q4_0"  # the table itself is left as it was
    types = budget.assign_types(budget.head_kept(table), budget.total_bytes(table, budget.mixture_types(table)))
    assert types["token_embd.weight"] == T.Q8_0 and types["output.weight"] in (T.Q6_K, T.Q8_0)


def test_raise_plan_takes_the_most_damaging_first_within_room():
    table = [row("a", 1.0), row("b", 50.0), row("c", 10.0)]
    ladder = mixed.Ladder(table, {"a": "Q2_K", "b": "Q2_K", "c": "Q2_K"}, budget.tensor_size)
    plan, raised = mixed.raise_plan(ladder, ladder.plan, count=2, room=10**9)
    assert raised == {"b": ("Q2_K", "Q3_K"), "c": ("Q2_K", "Q3_K")} and plan["a"] == "Q2_K"
    assert mixed.raise_plan(ladder, ladder.plan, 2, 10)[1] == {}  # no raise fits
    top = {name: "Q8_0" for name in ladder.plan}
    assert mixed.raise_plan(ladder, top, 2, 10**9)[1] == {}  # at the top


def test_override_lines_are_anchored_regexes():
    lines = budget.override_lines({"output.weight": T.Q6_K, "blk.0.attn_output.weight": T.Q4_K})
    assert lines == ["^blk\\.0\\.attn_output\\.weight$=q4_k", "^output\\.weight$=q6_k"]


def test_auto_precision_is_refused_for_methods_without_it(cli, micro_model, tmp_path):
    """--auto-precision exists for gguf, gptq, awq and autoround; --fallback for every method."""
    listed = "implemented for method gptq, awq, autoround and gguf only, not"
    for method in ("fp8", "nf4", "smoothquant"):
        result = cli("quantize", micro_model, "--method", method, "--auto-precision", "-o", tmp_path / "out")
        assert result.exit_code == 2 and f"{listed} {method}" in result.stderr, (method, result.stderr)


def sharpen(src: Path, dst: Path) -> Path:
    """A copy of the micro model that quantization visibly hurts, computed in float32: the output head
    scaled by 8 (peaked next-token distributions), and four input channels of every attention block
    carrying 16x activations against 1/16 weight columns (function preserving, as
    scripts/train_reference_model.py does), stored in float32 so the base runs in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    state["lm_head.weight"] *= 8
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        channels = torch.tensor([3, 50, 120, 200]) + layer
        state[prefix + "input_layernorm.weight"][channels] *= 16
        for proj in ("q_proj", "k_proj", "v_proj"):
            state[f"{prefix}self_attn.{proj}.weight"][:, channels] /= 16
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return dst


@pytest.fixture(scope="module")
def sharp(micro_model, tmp_path_factory) -> Path:
    return sharpen(micro_model, tmp_path_factory.mktemp("sharp") / "sharp")


@pytest.fixture(scope="module")
def auto_out(cli, sharp, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("auto") / "auto"
    result = cli("quantize", sharp, "--method", "gguf", "--gguf-type", "Q4_K_M", "--auto-precision", *CALIB,
                 "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
def test_auto_precision_keeps_the_mixture_size(auto_out, sharp):
    from quantkit.gguf.convert import convert

    details = json.loads((auto_out / "quantkit.json").read_text())["targets"][0]["details"]
    mixed = details["mixed_precision"]
    assert mixed["bytes"] <= mixed["budget_bytes"] == mixed["mixture_bytes"]
    assert mixed["changed"]  # some tensor got another type than llama.cpp's rule gives it
    measured = mixed["measured"]  # the maps measured whole, the lowest KL divergence kept
    klds = measured["kld"]
    assert "search" in klds and "mixture" in klds
    assert klds[measured["kept"]] == min(klds.values()) and measured["kept"] != "mixture"
    mixture_file = convert(sharp, auto_out.parent / "mixture.gguf", "Q4_K_M")
    assert details["gguf"]["bytes"] <= mixture_file.bytes
    table = details["sensitivity"]
    # the probes and the maps on the same windows: as many as one pass of the 4 calibration windows pays for
    assert table["measured"] and table["windows"] == measured["windows"] == 1
    assert {r["tensor"] for r in table["tensors"]} == set(mixed["types"])
    assert all(r["gain"] is not None for r in table["tensors"])
    assert 0 < table["probes"] <= len(table["tensors"])  # up to 3 per role (2 layers here: every tensor)
    for r in table["tensors"]:  # damage falls with every step up the tensor's candidates
        damages = [r["damage"][c] for c in r["candidates"]]
        assert all(a >= b for a, b in zip(damages, damages[1:])), r
    lines = (auto_out / "tensor-types.txt").read_text().split()
    assert len(lines) == len(mixed["types"]) and all(ln.startswith("^") for ln in lines)


def test_a_search_that_measures_worse_than_the_mixture_gives_way_to_it(cli, sharp, tmp_path, monkeypatch):
    """The per-tensor damage model is an estimate: when the types it picks measure a higher KL divergence
    than llama.cpp's mixture of the same size (here forced: every tensor at its cheapest type), the
    mixture is written, and the report says so with both measurements."""
    from quantkit.gguf.convert import convert
    from quantkit.mixed import gguf as budget
    from tests.gguf.helpers import tensor_bytes

    monkeypatch.setattr(budget, "assign_types",
                        lambda table, allowed: {t.name: budget.T[t.candidates[0]] for t in table})
    recipe = tmp_path / "auto.yaml"
    recipe.write_text("targets:\n  - name: auto\n    method: gguf\n    options: {gguf_type: Q4_K_M, imatrix: none,"
                      " auto_precision: {measure_windows: 2, probes_per_role: 1}}\n")
    out = tmp_path / "auto"
    result = cli("quantize", sharp, "--recipe", recipe, *CALIB, "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    mixed = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["mixed_precision"]
    measured = mixed["measured"]
    assert measured["kept"] == "mixture" and measured["kld"]["mixture"] < measured["kld"]["search"]
    assert not mixed["changed"] and mixed["bytes"] == mixed["mixture_bytes"]
    mixture = convert(sharp, tmp_path / "mixture.gguf", "Q4_K_M", imatrix=None)
    assert tensor_bytes(out / "sharp-Q4_K_M.gguf") == tensor_bytes(mixture.path)


def test_inspect_shows_the_sensitivity_table(cli, auto_out, sharp):
    result = cli("inspect", auto_out, "--sensitivity")
    assert result.exit_code == 0, result.output
    assert "per-tensor sensitivity" in result.stdout and "blk.0.ffn_down.weight" in result.stdout
    data = json.loads(cli("inspect", auto_out, "--sensitivity", "--json", "-").stdout)
    assert data["gguf"]["sensitivity"]["tensors"]
    result = cli("inspect", sharp, "--sensitivity")
    assert result.exit_code == 2 and "no quantkit.json" in result.stderr


@pytest.mark.slow
def test_damage_model_ranks_tensors_like_measured_kld(auto_out, sharp):
    """The damage predicted at Q2_K (gains measured at Q3_K on a few probes per role, interpolated over
    depth for the rest, times the weighted error) ranks the decoder tensors as their KL divergence
    measured at Q2_K does. (The weighted error alone does not: its units differ between tensor kinds;
    docs/gguf.md reports both correlations.)"""
    import torch
    from scipy.stats import spearmanr

    from quantkit.engines.transformers import load_tokenizer
    from quantkit.gguf.convert import load_hparams, plan_tensors
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.mixed.gguf import Sensitivity, measure_klds
    from quantkit.mixed.sensitivity import SensitivityRow
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    table = Sensitivity.from_dict(json.loads((auto_out / "quantkit.json").read_text())["targets"][0]["details"]
                                  ["sensitivity"]).tensors
    rows = [r for r in table if r.name.startswith("blk.")]
    predicted = [r.damage("Q2_K") for r in rows]
    info = check_model_dir(sharp)
    plans = plan_tensors({**load_hparams(sharp), "architectures": info.config["architectures"]}, info.tensors,
                         "Q4_K_M", model_dir=sharp)
    windows = make_windows(load_tokenizer(info), Calibration(num_samples=4, seq_len=64, eval_windows=4)).calib
    probes = [SensitivityRow(r.name, r.shape, r.errors, "Q2_K") for r in rows]
    with torch.inference_mode():
        measure_klds(sharp, probes, plans, None, windows)
    rho = spearmanr(predicted, [r.kld for r in probes]).statistic
    assert rho >= 0.8, rho


def test_fallback_turns_a_failing_gate_into_a_passing_artifact(cli, sharp, tmp_path):
    """Plain Q2_K measures KLD ~3e-3 on this model, past the 1.5e-3 gate; raising the most damaging
    tensors brings it to ~5e-4 within two steps, well inside."""
    gate = ("--max-kld", "0.0015", "--min-top1", "0", "--max-ppl-increase", "10")
    plain = cli("quantize", sharp, "--method", "gguf", "--gguf-type", "Q2_K", *CALIB, *gate, "-o", tmp_path / "plain")
    assert plain.exit_code == 3
    recipe = tmp_path / "fallback.yaml"
    recipe.write_text("targets:\n  - name: q2\n    method: gguf\n"
                      "    options: {gguf_type: Q2_K, fallback: {max_size: '+40%', tensors_per_step: 3}}\n")
    out = tmp_path / "fallback"
    result = cli("quantize", sharp, "--recipe", recipe, *CALIB, *gate, "-o", out)
    assert result.exit_code == 0, result.output
    target = json.loads((out / "quantkit.json").read_text())["targets"][0]
    fallback = target["details"]["fallback"]
    steps = fallback["steps"]
    assert not steps[0]["passed"] and steps[-1]["passed"] and len(steps) >= 2
    assert all(s["raised"] for s in steps[1:])
    assert target["gate"]["passed"] and target["metrics"] == steps[-1]["metrics"]
    assert fallback["size_cost_bytes"] == steps[-1]["bytes"] - steps[0]["bytes"] > 0
    assert steps[-1]["bytes"] <= steps[0]["bytes"] * 1.4
    assert (out / "sharp-Q2_K.gguf").stat().st_size == steps[-1]["bytes"]
    assert fallback["types"] and (out / "tensor-types.txt").is_file()


@pytest.mark.slow
@pytest.mark.llamacpp
def test_llama_quantize_reproduces_auto_precision_bytes(cli, micro_f16, tmp_path):
    """llama-quantize --imatrix F --tensor-type-file <ours> on the F16 GGUF == quantkit's auto-precision file."""
    import subprocess

    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.gguf import imatrix as im
    from tests.gguf.helpers import convert_to, need_llama, tensor_bytes

    quantize = need_llama("llama-quantize")
    model = AutoModelForCausalLM.from_pretrained(micro_f16, dtype=torch.float32).eval()
    windows = torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(2))
    imatrix = im.write(im.compute(model, windows, model.config.to_dict()), tmp_path / "imatrix.gguf")
    out = tmp_path / "auto"
    result = cli("quantize", micro_f16, "--method", "gguf", "--gguf-type", "Q3_K_M", "--imatrix", imatrix,
                 "--auto-precision", *CALIB, "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    f16, theirs = tmp_path / "f16.gguf", tmp_path / "theirs.gguf"
    convert_to(micro_f16, f16, "F16")
    subprocess.run([str(quantize), "--imatrix", str(imatrix), "--tensor-type-file", str(out / "tensor-types.txt"),
                    str(f16), str(theirs), "Q3_K_M", "1"], check=True, capture_output=True, text=True)
    ours = tensor_bytes(out / "micro16-Q3_K_M.gguf")
    assert tensor_bytes(theirs) == ours
    changed = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["mixed_precision"]["changed"]
    assert changed  # the types differ from the mixture's, and llama-quantize still gives the same bytes


def test_auto_precision_on_rows_no_k_quant_fits_stays_within_the_mixture(cli, odd_model, tmp_path):
    """hidden 192: every tensor but ffn_down has only llama.cpp's fallback types; the chosen types are
    those, the file is no larger than the Q4_K_M mixture's, and llama.cpp's mixture is what it beats."""
    from quantkit.gguf.convert import convert

    out = tmp_path / "auto"
    result = cli("quantize", odd_model, "--method", "gguf", "--gguf-type", "Q4_K_M", "--auto-precision", *CALIB,
                 "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    details = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]
    mixed_precision, table = details["mixed_precision"], details["sensitivity"]["tensors"]
    assert mixed_precision["bytes"] <= mixed_precision["budget_bytes"] == mixed_precision["mixture_bytes"]
    legacy = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"}  # the 32-value types
    narrow = [r for r in table if r["shape"][-1] == 192]
    assert narrow and all(set(r["candidates"]) <= legacy for r in narrow)
    assert all(mixed_precision["types"][r["tensor"]] in legacy for r in narrow)
    mixture = convert(odd_model, tmp_path / "mixture.gguf", "Q4_K_M", imatrix=None)
    assert (out / "odd-Q4_K_M.gguf").stat().st_size <= mixture.path.stat().st_size


def test_a_budget_no_type_can_meet_is_refused_before_work(cli, odd_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--method", "gguf", "--gguf-type", "Q4_K_M", "--budget-bpw", "2.5", *CALIB,
                 "-o", out)
    assert result.exit_code == 2, result.output
    assert "gguf auto_precision: a budget of" in result.stderr and "cannot be met" in result.stderr
    assert "the cheapest types take" in result.stderr and "imatrix" not in result.stderr
    assert not out.exists()


def rewritten_model(tmp_path: Path, family: str) -> Path:
    """A tiny checkpoint of a family whose conversion changes tensors before writing them."""
    if family == "granitemoehybrid":
        from tests.families import test_granite

        return test_granite.build(tmp_path / "model", **test_granite.MOE)
    if family == "qwen3_5_text":
        from tests.families import test_qwen35

        return test_qwen35.build(tmp_path / "model")
    from tests.families.test_moe import build

    return build(tmp_path / "model", family)


REWRITTEN = ["deepseek_v3", "qwen3_next", "gpt_oss", "llama4_text", "granitemoehybrid", "qwen3_5_text"]


@pytest.mark.parametrize("family", REWRITTEN)
def test_a_type_map_of_rewritten_tensors_is_what_the_file_reads_back(tmp_path, family):
    """Where the converter changes a tensor before writing it (DeepSeek's kv_b_proj cut into attn_k_b / attn_v_b,
    Qwen3-Next's in_proj_qkvz into attn_qkv / attn_gate, GPT-OSS's and Llama 4's stacked experts transposed and
    de-interleaved, Granite 4's stacked input_linear split, Qwen3.5's value heads reordered), the sensitivity reads
    the written values: the source got back with nothing quantized is the stored tensor, and with the mixture's
    types applied it is the tensor the gate reads from the converted file, element for element; each rewritten
    tensor's weighted error is measured on its written matrices."""
    import numpy as np
    import torch

    from quantkit.eval.experts import RenamedWeights
    from quantkit.gguf.convert import convert, open_handles
    from quantkit.gguf.loader import GGUFTensors
    from quantkit.gguf.mixture import UNQUANTIZED
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.gguf import model_plans
    from quantkit.mixed.gguf import TypedMatrices, rewritten, tensor_errors, written_of

    model_dir = rewritten_model(tmp_path, family)
    info = check_model_dir(model_dir)
    plans = model_plans(info, "Q4_K_M", False)
    handles = open_handles(info.weight_files)
    written = written_of(model_dir, handles, plans)
    quantized = {p.name: p.qtype for p in plans if p.qtype not in UNQUANTIZED}
    sources = {hf for hf, pieces in written.pieces.items() if all(p.name in quantized for p in pieces)}
    assert sources, [p.name for p in plans if rewritten(p)]
    for hf in sources:
        stored = handles[hf].read(hf, 0, handles[hf].header[hf]["shape"][0])
        assert np.array_equal(written.source(hf, {}), stored.reshape(written.source(hf, {}).shape)), hf
    convert(model_dir, tmp_path / "model.gguf", "Q4_K_M")
    reading = GGUFTensors(tmp_path / "model.gguf", json.loads((model_dir / "config.json").read_text()))
    typed = TypedMatrices(handles, plans, quantized, None, written=written)
    read_as = {stored: name for name, stored in RenamedWeights(typed, None, info.config["model_type"]).names.items()}
    for hf in sources:  # the reading names tensors as transformers' model does (Granite 4 MoE's experts renamed)
        assert torch.equal(typed[hf], reading.get(read_as[hf]).reshape(typed[hf].shape)), hf
    plan = next(p for p in plans if p.hf_name in sources)
    errors = tensor_errors(handles, plan, None, None, None, written=written)
    assert errors and all(np.isfinite(v) and v > 0 for v in errors.values())
