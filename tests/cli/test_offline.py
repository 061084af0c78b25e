"""Offline proof: full runs in a subprocess where opening a network socket fails and is recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.util import subprocess_env

# Loaded by Python at startup from PYTHONPATH: any internet socket, DNS lookup or connection
# attempt is written to NETWORK_LOG and fails (so a library that swallows the error is still caught).
SITECUSTOMIZE = '''
import json
import os
import socket
import traceback

_LOG = os.environ["QUANTKIT_TEST_NETWORK_LOG"]
_NET = (socket.AF_INET, socket.AF_INET6)


def _refuse(what):
    with open(_LOG, "a") as fh:
        fh.write(json.dumps({"what": what, "stack": traceback.format_stack(limit=12)}) + "\\n")
    raise OSError("network access blocked by quantkit's offline test: " + what)


class _NoNetSocket(socket.socket):
    def __init__(self, family=socket.AF_INET, type=socket.SOCK_STREAM, proto=0, fileno=None):
        if fileno is None and family in _NET:
            _refuse(f"socket({family!r})")
        super().__init__(family, type, proto, fileno)


def _getaddrinfo(host, *args, **kwargs):
    _refuse(f"getaddrinfo({host!r})")


def _create_connection(address, *args, **kwargs):
    _refuse(f"create_connection({address!r})")


socket.socket = _NoNetSocket
socket.getaddrinfo = _getaddrinfo
socket.create_connection = _create_connection
'''

# urllib3 probes IPv6 support at import by opening (not connecting) a socket on ::1; it
# handles the refusal and no address is ever contacted.
LOCAL_PROBES = ("_has_ipv6",)


def network_attempts(log) -> list[str]:
    """What the run tried, less the local capability probes: each entry's action and stack."""
    if not log.exists():
        return []
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    return [e["what"] + "\n" + "".join(e["stack"]) for e in entries
            if not any(probe in "".join(e["stack"]) for probe in LOCAL_PROBES)]


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


@pytest.fixture
def no_network_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "network.log"
    env = subprocess_env(PYTHONPATH=str(site), QUANTKIT_TEST_NETWORK_LOG=str(log))
    for name in OFFLINE_VARIABLES:
        env.pop(name, None)
    return env, log


def test_the_block_works(no_network_env):
    env, log = no_network_env
    code = "import urllib.request; urllib.request.urlopen('http://example.com', timeout=5)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "blocked by quantkit's offline test" in proc.stderr
    assert log.is_file()


def test_fp8_and_gguf_run_with_the_network_blocked(micro_model, tmp_path, no_network_env):
    env, log = no_network_env
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "quantkit", "quantize", "--recipe", "release", "--only", "fp8-dynamic,gguf-q4_k_m",
           "--model", str(micro_model), "-o", str(out), "--num-samples", "16", "--seq-len", "64", "--eval-windows", "4",
           "--no-gate", "--json", str(tmp_path / "report.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert network_attempts(log) == []
    report = json.loads((tmp_path / "report.json").read_text())
    assert [t["method"] for t in report["targets"]] == ["fp8", "gguf"]
    assert all(t["metrics"] for t in report["targets"])
    assert (out / "fp8-dynamic" / "model.safetensors").is_file()
    assert [p.suffix for p in (out / "gguf-q4_k_m").glob("*.gguf")] == [".gguf"]
