"""The KV geometry (mooncake/kv_geometry.py): read from a model's config as the backends read it, and
the bytes it gives a block are the bytes the paged cache really holds per block."""

import pytest
import torch

from mooncake.engine.kv_cache import PagedKVCache
from mooncake.errors import ModelError
from mooncake.kv_geometry import KVSpec

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def test_head_dim_and_kv_heads_default_as_hugging_face_configs_mean_them():
    assert KVSpec.from_model_config(SMOLLM2) == KVSpec(30, 3, 64)  # GQA; head_dim = hidden / heads
    assert KVSpec.from_model_config({**SMOLLM2, "num_key_value_heads": None}) == KVSpec(30, 9, 64)  # MHA
    assert KVSpec.from_model_config({"num_hidden_layers": 8, "num_key_value_heads": 1, "head_dim": 4}) \
        == KVSpec(8, 1, 4)  # an emulated model's config names no attention heads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_blocks_bytes_are_what_the_paged_cache_holds_per_block(dtype):
    spec, blocks, size = KVSpec(3, 2, 8), 5, 4
    cache = PagedKVCache(spec, blocks, size, getattr(torch, dtype), torch.device("cpu"))
    assert spec.block_bytes(size, dtype) * blocks == cache.kv.numel() * cache.kv.element_size()


def test_a_config_without_the_shape_or_an_unknown_dtype_is_an_error_naming_it():
    with pytest.raises(ModelError, match="num_hidden_layers"):
        KVSpec.from_model_config({"head_dim": 4, "num_key_value_heads": 1})
    with pytest.raises(ModelError, match="int8"):
        KVSpec(1, 1, 1).token_bytes("int8")
