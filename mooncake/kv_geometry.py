"""A model's KV geometry, torch-free, in one place: what it stores per token (layers x K|V x KV heads x
head dim), read from its config.json, and what a token or a block of it weighs in a dtype. The model
backends shape their caches by it, the engine sizes its cache by it, and the conductor prices moving a
block with it (it loads no torch)."""

from dataclasses import dataclass

from mooncake.errors import ModelError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a resolved engine dtype (EngineConfig.kv_dtype)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ModelError(f"KV dtype {dtype!r}: must be one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class KVSpec:
    """What a model needs stored per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_model_config(cls, config: dict) -> "KVSpec":
        """From a Hugging Face config.json's fields: `head_dim` defaults to hidden_size / heads and
        `num_key_value_heads` to the attention heads (no GQA)."""
        try:
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
            return cls(config["num_hidden_layers"], kv_heads, head_dim)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            raise ModelError(f"model config: no KV geometry ({type(exc).__name__}: {exc})") from None

    def token_bytes(self, dtype: str) -> int:
        """One token's K and V over every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)

    def block_bytes(self, block_size: int, dtype: str) -> int:
        return block_size * self.token_bytes(dtype)
