"""serve-check --kv-cache: the engine started with one KV-cache type and compared with quantkit's reading through
the same type; what the engine's served log-probs cannot show is refused before any server starts."""

from pathlib import Path

import pytest

from quantkit.errors import InputError, UnsupportedError
from quantkit.serve import llama_server, support, vllm_server
from quantkit.serve.check import served_kv_type
from quantkit.serve.engines import Installed
from quantkit.serve.settings import ServeOptions


def test_one_type_of_the_engine_is_taken(micro_model):
    cpu = support.accelerator()
    kind = served_kv_type("llama.cpp:q8_0/q4_0", "llama.cpp", micro_model, cpu)
    assert kind.name == "llama.cpp:q8_0/q4_0" and "-ctv" in kind.flag
    assert served_kv_type(None, "llama.cpp", micro_model, cpu) is None
    assert served_kv_type("vllm:fp8", "vllm", micro_model, cpu).flag == ("--kv-cache-dtype", "fp8")


@pytest.mark.parametrize("spec, engine, error, words", [
    ("mlx:4", "mlx", UnsupportedError, "--quantized-kv-start"),
    ("llama.cpp:q8_0,llama.cpp:q4_0", "llama.cpp", InputError, "give one type"),
    ("auto", "llama.cpp", InputError, "give one type"),
    ("vllm:fp8", "llama.cpp", UnsupportedError, "served by llama.cpp"),
])
def test_what_the_served_log_probs_cannot_show_is_refused(micro_model, spec, engine, error, words):
    with pytest.raises(error, match=words):
        served_kv_type(spec, engine, micro_model, support.accelerator())


def test_turboquant_reads_raw_prefill_and_is_refused(micro_model, monkeypatch):
    """vLLM's TurboQuant attends over a prompt's raw keys and values in its first prefill chunk (a GPU type)."""
    gpu = support.Accelerator("cuda", "a GPU", 9.0)
    with pytest.raises(UnsupportedError, match="raw keys"):
        served_kv_type("vllm:turboquant_k8v4", "vllm", micro_model, gpu)


def test_the_engines_are_started_with_the_types_flags(tmp_path):
    options = ServeOptions(max_model_len=128, kv_flags=("-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"))
    engine = Installed("llama.cpp", Path("/bin/llama-server"), "PATH")
    command = llama_server.command(engine, tmp_path / "m.gguf", 8080, options)
    assert command[-6:] == ["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"]
    vllm = Installed("vllm", Path("/venv/bin/vllm"), "PATH")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    command = vllm_server.command(vllm, tmp_path / "m", 8080, ServeOptions(max_model_len=128,
                                                                           kv_flags=("--kv-cache-dtype", "fp8_e5m2")))
    assert command[-2:] == ["--kv-cache-dtype", "fp8_e5m2"]


def test_the_gate_serves_the_type_it_chose_where_the_engine_shows_it(micro_model):
    """quantize --kv-cache ... --serve-check: the engine started with the chosen type; mlx_lm.server and a raw-prefill
    type served with a 16-bit cache, and the report says why (serve-check's own refusal)."""
    from types import SimpleNamespace

    from quantkit.run.pipeline import served_kv_choice

    cpu, gpu = support.accelerator(), support.Accelerator("cuda", "a GPU", 9.0)

    def served_kv_choice_by(entry, engine, accelerator=cpu):
        return served_kv_choice(entry, Installed(engine, Path("/bin/true"), "PATH"), micro_model, accelerator)

    def entry(chosen):
        types = [{"type": chosen}] if chosen else []
        return SimpleNamespace(details={"kv_cache_types": {"types": types, "chosen": chosen}})

    assert served_kv_choice_by(entry("llama.cpp:q8_0"), "llama.cpp") == "llama.cpp:q8_0"
    assert served_kv_choice_by(entry(None), "llama.cpp") is None
    assert served_kv_choice_by(SimpleNamespace(details={}), "vllm") is None
    for chosen, engine, accelerator, why in (("mlx:4", "mlx", cpu, "--quantized-kv-start"),
                                             ("vllm:turboquant_k8v4", "vllm", gpu, "raw keys")):
        served = entry(chosen)
        assert served_kv_choice_by(served, engine, accelerator) is None
        note = served.details["kv_cache_types"]["serve_check"]
        assert "16-bit cache" in note and why in note


# ---------------------------------------------------------------- end to end (slow: a trained model, a real server)

from tests.serve.test_serve_check_slow import quantized, require, serve_check, trained  # noqa: E402,F401


@pytest.mark.slow
def test_llama_server_with_a_quantized_cache_reads_as_quantkit_simulates_it(cli, quantized, tmp_path):
    """llama-server started with a q4_0 K and V cache (flash attention): its log-probs follow quantkit's reading
    through the same cache, and lie closer to it than to the reading with a 16-bit cache."""
    require(llama_server.find, "llama.cpp's llama-server", "QUANTKIT_LLAMA_CPP")
    artifact = quantized("Q8_0", "--method", "gguf", "--gguf-type", "Q8_0")
    code, data, stderr = serve_check(cli, artifact, tmp_path, "--logprobs", "0", "--kv-cache", "llama.cpp:q4_0")
    assert code == 0, stderr
    command, kv = data["engine"]["command"], data["kv_cache"]
    assert command[command.index("-ctk") + 1] == "q4_0" and command[command.index("-ctv") + 1] == "q4_0"
    assert kv["type"] == "llama.cpp:q4_0"
    with_type, without = data["vs_reading"]["kld_lower_bound"], kv["vs_reading_16bit_cache"]["kld_lower_bound"]
    assert with_type < 0.01 and with_type < without


@pytest.mark.slow
def test_vllm_with_an_fp8_cache_reads_as_quantkit_simulates_it(cli, quantized, tmp_path):
    """vLLM (its CPU build here) started with --kv-cache-dtype fp8: its log-probs lie closer to quantkit's reading
    through the same cache than to the reading with a 16-bit cache."""
    require(vllm_server.find, "vLLM", "QUANTKIT_VLLM")
    artifact = quantized("fp8", "--method", "fp8")
    code, data, stderr = serve_check(cli, artifact, tmp_path, "--kv-cache", "vllm:fp8")
    assert code == 0, stderr
    command, kv = data["engine"]["command"], data["kv_cache"]
    assert command[command.index("--kv-cache-dtype") + 1] == "fp8" and kv["type"] == "vllm:fp8"
    with_type, without = data["vs_reading"]["kld_lower_bound"], kv["vs_reading_16bit_cache"]["kld_lower_bound"]
    assert with_type < 0.01 and with_type < without  # the CPU backend's truncating fp8 store, simulated
