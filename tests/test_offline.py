"""No run reaches a model hub (DESIGN): qft's entry points keep the Hugging Face stack offline, which matters
from the first import, where bitsandbytes asks the Hub for a CPU kernel on AVX512-BF16 CPUs."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("kernels")  # what bitsandbytes fetches through; without it there is nothing to fetch

# In a fresh process: refuse and count every name lookup and connection, import the entry point, then do what
# bitsandbytes does at import on an AVX512-BF16 CPU (asked for explicitly, so the probe holds on every CPU).
PROBE = """
import importlib, socket, sys
tried = []
def refuse(*args, **kwargs):
    tried.append(args[:1])
    raise OSError("no network in this test")
socket.getaddrinfo = refuse
socket.socket.connect = refuse
importlib.import_module(sys.argv[1])
import bitsandbytes
from kernels import get_kernel
try:
    get_kernel("kernels-community/quantization-bitsandbytes", version=1)
except Exception:
    pass
print(len(tried), tried[:2])
"""


def attempts(module: str, **env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", PROBE, module], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("entry", ["qft.__main__", "qft.tools.predict"])
def test_an_entry_point_reaches_no_hub(entry):
    assert attempts(entry) == "0 []"


def test_the_probe_sees_a_hub_attempt_where_the_user_allows_one():
    """The control: an explicit HF_HUB_OFFLINE=0 is the user's to set, and the probe counts what it lets through."""
    count = int(attempts("qft.__main__", HF_HUB_OFFLINE="0").split()[0])
    assert count > 0
