import json
import shutil

import pytest

from mooncake.errors import ModelError, UnsupportedModelError
from mooncake.models import resolve_model


def test_catalog_name_and_directory_resolve_to_the_same_weights(tiny_dir):
    by_name = resolve_model("tiny-llama")
    by_path = resolve_model(str(tiny_dir))
    assert by_name.path == by_path.path == tiny_dir
    assert by_name.model_id == by_path.model_id


def test_model_id_follows_the_weights(tiny_dir, tmp_path):
    copy = shutil.copytree(tiny_dir, tmp_path / "tiny-llama")
    assert resolve_model(str(copy)).model_id == resolve_model(str(tiny_dir)).model_id
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert resolve_model(str(copy)).model_id != resolve_model(str(tiny_dir)).model_id


@pytest.mark.parametrize("name, match", [
    ("no-such-model", "unknown model 'no-such-model'"),
    ("./no/such/dir", "does not exist"),
])
def test_unknown_names_and_missing_paths(name, match):
    with pytest.raises(ModelError, match=match):
        resolve_model(name)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_is_named(tiny_dir, tmp_path):
    copy = shutil.copytree(tiny_dir, tmp_path / "m")
    config = json.loads((copy / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*GPT2LMHeadModel"):
        resolve_model(str(copy))


def test_directory_without_weights(tiny_dir, tmp_path):
    copy = shutil.copytree(tiny_dir, tmp_path / "m")
    for f in copy.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        resolve_model(str(copy))
