"""The engine contract runs on the tiny model and on the emulated one alike (no numeric parity for the
emulated one): a module that asks for `cfg` runs once per model."""

import pytest

from mooncake.config import EngineConfig


@pytest.fixture(scope="module", params=["tiny", "emulated"])
def cfg(request, tiny_dir):
    from mooncake.models.fetch import fetch_model
    path = tiny_dir if request.param == "tiny" else fetch_model("emulated-llama3-70b")
    return EngineConfig(model=str(path), block_size=8, prefill_chunk=16, num_kv_blocks=256, emulation_speedup=1000)
