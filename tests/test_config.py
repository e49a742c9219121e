import pytest

from mooncake.config import EngineConfig, MooncakeConfig, load_config
from mooncake.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_without_file():
    assert load_config() == MooncakeConfig()
    assert load_config().engine.device == "cpu"


def test_values_are_loaded(tmp_path):
    cfg = load_config(write(tmp_path, "[engine]\nblock_size = 32\nmodel = 'tiny-llama'\n"))
    assert cfg.engine.block_size == 32 and cfg.engine.model == "tiny-llama"


@pytest.mark.parametrize("text, key", [
    ("[engine]\nblok_size = 32\n", "engine.blok_size"),
    ("[engin]\nblock_size = 32\n", "engin"),
    ("[engine]\nblock_size = 'big'\n", "engine.block_size"),
    ("[engine]\nblock_size = 0\n", "engine.block_size"),
    ("[engine]\ndtype = 'int8'\n", "engine.dtype"),
    ("engine = 3\n", "engine"),
    ("[cache]\ntransport = 'rdma9'\n", "cache.transport"),
    ("[cache]\ncontrol_address = '7600'\n", "cache.control_address"),
    ("[cache_client]\nnodes = ['tcp://a:1']\nreplica_num = 2\n", "cache_client.replica_num"),
    ("[store]\neviction = 'fifo'\n", "store.eviction"),
    ("[conductor]\nplacement = 'magic'\n", "conductor.placement"),
    ("[conductor]\ntbt_slo_s = 0\n", "conductor.tbt_slo_s"),
    ("[instance]\nstream_kv = false\nstream_layers = true\n", "instance.stream_layers"),
])
def test_bad_keys_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(write(tmp_path, text))


def test_overrides_apply_and_are_checked():
    assert load_config(overrides={"engine.device": "cuda"}).engine.device == "cuda"
    with pytest.raises(ConfigError, match="engine.nope"):
        load_config(overrides={"engine.nope": 1})


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[engine\n"))


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        EngineConfig().block_size = 3


def test_every_shipped_config_loads():
    from pathlib import Path
    files = sorted(Path(__file__).parents[1].glob("configs/**/*.toml"))
    serving = [f for f in files if "models" not in f.parts]  # configs/models/ holds model specs
    assert len(serving) >= 8
    for f in serving:
        load_config(f)


def test_dump_config_round_trips():
    import tomllib
    from mooncake.config import dump_config, from_dict, MooncakeConfig
    cfg = load_config(None, {"engine.model": 'we"ird\\\\path', "cache_client.nodes": ["tcp://a:1", "tcp://b:2"],
                             "api.port": 0, "conductor.tbt_slo_s": 0.25})
    assert from_dict(MooncakeConfig, tomllib.loads(dump_config(cfg))) == cfg


def test_the_shared_layer_validates_backend_names_without_importing_a_role():
    import subprocess
    import sys
    code = ("import sys; from mooncake.config import load_config; load_config(None); "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['mooncake', 'conductor'], ['mooncake', 'store'], ['mooncake', 'engine'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_third_party_transport_registered_by_entry_point_is_a_valid_name(monkeypatch):
    from importlib.metadata import EntryPoint

    import mooncake.registry
    ep = EntryPoint("transports.carrier-pigeon", "somewhere:Pigeon", "mooncake.backends")
    monkeypatch.setattr(mooncake.registry, "entry_points", lambda group: [ep] if group == "mooncake.backends" else [])
    assert load_config(None, {"instance.transport": "carrier-pigeon"}).instance.transport == "carrier-pigeon"
    with pytest.raises(ConfigError, match="instance.transport.*carrier-pigeon.*'owl'"):
        load_config(None, {"instance.transport": "owl"})


def test_auto_dtype_is_bfloat16_where_the_hardware_runs_it_fast_and_float32_elsewhere():
    from mooncake.config import resolve_dtype
    assert resolve_dtype("auto", "cpu", {"avx2", "avx512f"}) == "float32"
    assert resolve_dtype("auto", "cpu", {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert resolve_dtype("auto", "cpu", {"amx_tile", "amx_bf16"}) == "bfloat16"
    assert resolve_dtype("auto", "cuda:0", set()) == "bfloat16"
    assert resolve_dtype("float32", "cuda", {"amx_bf16"}) == "float32"  # an explicit dtype is kept
    cfg = load_config(None, {"engine.dtype": "auto"})
    assert cfg.engine.kv_dtype == resolve_dtype("auto", "cpu") and cfg.engine.dtype == "auto"


def test_dev_defaults_fit_one_full_context_of_the_default_model_in_the_dtype_they_choose():
    from mooncake.cli import dev_defaults
    from mooncake.models import resolve_model
    cfg = load_config(None, dev_defaults())
    model = resolve_model(cfg.engine.model).config
    kv_heads = model.get("num_key_value_heads", model["num_attention_heads"])
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    per_token = 2 * model["num_hidden_layers"] * kv_heads * head_dim * (4 if cfg.engine.kv_dtype == "float32" else 2)
    assert cfg.engine.kv_cache_bytes // per_token >= model["max_position_embeddings"] >= 8192


@pytest.mark.parametrize("key, value, words", [
    ("conductor.estimator_prior_scale", 0, "must be > 0"),
    ("conductor.output_lengths", "oracle", "'learned' or 'max_tokens'"),
    ("conductor.output_tokens_prior", 0, "must be > 0"),
    ("sim.max_tokens", -1, "must be >= 0"),
    ("sim.step_model", "sum", "roofline, additive"),
    ("engine.emulation_step_model", "sum", "roofline, additive"),
])
def test_the_capacity_studys_keys_are_checked_by_name(key, value, words):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as caught:
        load_config(None, {key: value})
    assert words in str(caught.value)
