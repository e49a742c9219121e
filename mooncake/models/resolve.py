"""Turn what a user typed (`--model NAME_OR_PATH`) into a checked model directory and a stable model id."""

import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

from mooncake.errors import ModelError, UnsupportedModelError
from mooncake.models.catalog import CATALOG, SUPPORTED_MODEL_TYPES

FINGERPRINT_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class ModelSpec:
    """A model ready to load: its directory, raw config, and an id derived from its content."""

    path: Path
    model_id: str  # "<name>-<xxh3 of config and weights>": equal weights give equal KV keys on any node
    config: dict


def resolve_model(name_or_path: str, fetch: bool = True) -> ModelSpec:
    """A catalog name (fetched on first use when `fetch`) or a local Hugging Face directory."""
    path = Path(name_or_path).expanduser()
    if name_or_path in CATALOG and not path.exists():
        from mooncake.models.fetch import fetch_model, is_fetched
        if not fetch and not is_fetched(name_or_path):
            raise ModelError(f"model '{name_or_path}' is not fetched yet: run `mooncake model fetch {name_or_path}`")
        path = fetch_model(name_or_path)
    elif not path.exists():
        if "/" in name_or_path or name_or_path.startswith("."):
            raise ModelError(f"model path does not exist: {name_or_path}")
        raise ModelError(f"unknown model '{name_or_path}': not a local directory and not one of "
                         f"{', '.join(sorted(CATALOG))}")
    if not path.is_dir():
        raise ModelError(f"model path is not a directory: {path}")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{config_file} is not valid JSON: {exc}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        arch = ", ".join(config.get("architectures") or []) or "unknown"
        raise UnsupportedModelError(f"unsupported architecture {model_type!r} ({arch}) in {path}: "
                                    f"mooncake runs {', '.join(SUPPORTED_MODEL_TYPES)} models")
    weights = sorted(path.glob("*.safetensors"))
    if not weights and model_type != "emulated":
        raise ModelError(f"{path} has no *.safetensors weights")
    return ModelSpec(path=path, model_id=f"{path.name}-{_fingerprint(config_file, weights)}", config=config)


# config.json keys that say who wrote the file, not what the model is
UNFINGERPRINTED_KEYS = ("transformers_version", "_name_or_path")


def _fingerprint(config_file: Path, weights: list[Path]) -> str:
    # NOTE: the same weights converted by another transformers version must get the same id, or instances
    # on hosts with different versions are refused by the conductor and share no KV.
    config = {k: v for k, v in json.loads(config_file.read_text()).items() if k not in UNFINGERPRINTED_KEYS}
    h = xxhash.xxh3_64()
    h.update(json.dumps(config, sort_keys=True).encode())
    for file in weights:
        with open(file, "rb") as f:
            while chunk := f.read(FINGERPRINT_CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()
