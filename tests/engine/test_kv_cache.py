"""Block export and import of the paged KV cache."""

import pytest
import torch

from mooncake.engine.kv_cache import KVSpec, PagedKVCache
from mooncake.kv_payload import KVPayload


@pytest.mark.parametrize("num_blocks, dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_an_exported_block_is_a_copy_that_round_trips_and_outlives_changes_to_the_cache(num_blocks, dtype):
    cache = PagedKVCache(KVSpec(num_layers=2, num_kv_heads=2, head_dim=4), num_blocks, block_size=4,
                         dtype=dtype, device=torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape).to(dtype))
    block = num_blocks - 1
    payload = cache.export_block(block, block_hash=7, namespace=b"ns")
    before = cache.kv[:, :, block * 4:(block + 1) * 4].clone()
    cache.kv.zero_()  # the block is reused: an exported payload must not change with it
    cache.import_block(block, KVPayload.from_bytes(payload.to_bytes()), namespace=b"ns")
    assert torch.equal(cache.kv[:, :, block * 4:(block + 1) * 4], before)
    one_layer = cache.export_block(block, block_hash=7, namespace=b"ns", layer=1)
    assert one_layer.shape == cache.block_shape(1) and one_layer.layer == 1
