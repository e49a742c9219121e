"""Block export and import of the paged KV cache."""

import pytest
import torch

from mooncake.engine.kv_cache import PagedKVCache
from mooncake.kv_geometry import KVSpec
from mooncake.kv_payload import KVPayload


@pytest.mark.parametrize("num_blocks, dtype", [(1, torch.float32), (3, torch.bfloat16)])
def test_an_exported_block_is_a_copy_that_round_trips_and_outlives_changes_to_the_cache(num_blocks, dtype):
    cache = PagedKVCache(KVSpec(num_layers=2, num_kv_heads=2, head_dim=4), num_blocks, block_size=4,
                         dtype=dtype, device=torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape).to(dtype))
    block = num_blocks - 1
    payload = cache.export_blocks([(block, 7)], b"ns")[0]
    before = cache.kv[:, :, block * 4:(block + 1) * 4].clone()
    cache.kv.zero_()  # the block is reused: an exported payload must not change with it
    cache.import_block(block, KVPayload.from_bytes(payload.to_bytes()), namespace=b"ns")
    assert torch.equal(cache.kv[:, :, block * 4:(block + 1) * 4], before)
    one_layer = cache.export_blocks([(block, 7)], b"ns", layer=1)[0]
    assert one_layer.shape == cache.block_shape(1) and one_layer.layer == 1


@pytest.mark.parametrize("layer", [None, 0, 2])
def test_exporting_many_blocks_at_once_gives_each_block_its_own_bytes_as_a_copy(layer):
    """A batch export (one gather for a layer, a copy per block for all layers) of scattered blocks in any
    order: each payload holds exactly its block's KV, checks out, and outlives a change to the cache."""
    cache = PagedKVCache(KVSpec(num_layers=3, num_kv_heads=2, head_dim=4), 8, block_size=4,
                         dtype=torch.float32, device=torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape))
    blocks = [(6, 60), (1, 10), (3, 30)]
    expected = [cache.export_blocks([pair], b"ns", layer)[0] for pair in blocks]  # one by one
    for block, _ in blocks:  # what the cache holds, read straight from the tensor
        whole = cache.kv[:, :, block * 4:(block + 1) * 4]
        want = (whole if layer is None else whole[layer]).contiguous().numpy().tobytes()
        assert bytes(expected[blocks.index((block, _))].data) == want
    payloads = cache.export_blocks(blocks, b"ns", layer)
    cache.kv.zero_()
    assert [p.block_hash for p in payloads] == [60, 10, 30]
    for payload, single in zip(payloads, expected):
        payload.verify(namespace=b"ns", dtype="float32", shape=cache.block_shape(layer))
        assert (payload.layer, bytes(payload.data)) == (layer, bytes(single.data))
    assert cache.export_blocks([], b"ns", layer) == []


@pytest.mark.parametrize("num_layers, layers", [(8, range(0, 4)), (8, range(5, 8)), (7, range(2, 4)), (3, range(0, 3))])
def test_a_stage_view_packs_its_blocks_inside_the_caches_blocks_it_holds(num_layers, layers):
    """A CPP stage of m layers sees the cache as L // m times as many blocks of its layers: writing all of
    the stage blocks inside cache block b changes block b's memory and nothing else; no two stage blocks
    share memory; and a stage block's layer exports as exactly what was written there."""
    cache = PagedKVCache(KVSpec(num_layers=num_layers, num_kv_heads=2, head_dim=4), 5, block_size=4,
                         dtype=torch.float32, device=torch.device("cpu"))
    view = cache.stage_view(layers)
    assert view.per_block == num_layers // len(layers)
    assert view.kv.shape == (len(layers), 2, view.per_block * 5 * 4, 2, 4)
    assert view.kv.data_ptr() == cache.kv.data_ptr()  # the same memory, not a copy
    inside = view.blocks_in([3], view.per_block)
    assert len(set(view.blocks_in([3, 1], 2 * view.per_block))) == 2 * view.per_block
    paged = view.kv.view(len(layers), 2, -1, 4, 2, 4)
    for n, block in enumerate(inside):
        paged[:, :, block] = n + 1.0
    changed = (cache.kv != 0).view(num_layers, 2, 5, 4, 2, 4).any(dim=(0, 1, 3, 4, 5))
    assert changed.tolist() == [b == 3 for b in range(5)]
    assert int((cache.kv != 0).sum()) == view.per_block * len(layers) * 2 * 4 * 2 * 4  # no overlap
    for n, block in enumerate(inside):
        (payload,) = cache.export_blocks([(block, 100 + n)], b"ns", layers.stop - 1, view=view)
        payload.verify(namespace=b"ns", dtype="float32", shape=cache.block_shape(0))
        assert payload.layer == layers.stop - 1
        assert bool((torch.frombuffer(bytearray(payload.data), dtype=torch.float32) == n + 1.0).all())
    with pytest.raises(ValueError, match="not one of the stage's"):
        cache.export_blocks([(inside[0], 1)], b"ns", layers.start - 1 if layers.start else layers.stop, view=view)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_layer_export_copies_on_its_side_stream_after_the_write_it_waits_for():
    """The engine thread queues a long computation, then writes a block, and marks the write; another
    thread exports the block after that mark, on the cache's side stream into pinned memory: it gets the
    written values (not those before the write), while the computing stream is left alone. An import
    lands its values through the same side stream."""
    import threading

    device = torch.device("cuda")
    cache = PagedKVCache(KVSpec(num_layers=2, num_kv_heads=2, head_dim=64), 16, block_size=16,
                         dtype=torch.float32, device=device)
    big = torch.randn(2048, 2048, device=device)
    for _ in range(50):  # the default stream stays busy for a while
        big = (big @ big).clamp_(-1, 1)
    cache.kv[1, :, 5 * 16:6 * 16].fill_(7.0)  # queued behind the matmuls
    written = cache.mark_written()
    out = {}
    worker = threading.Thread(target=lambda: out.update(p=cache.export_blocks([(5, 55)], b"ns", 1, written)))
    worker.start()
    worker.join(timeout=60)
    payload = out["p"][0]
    values = torch.frombuffer(bytearray(payload.data), dtype=torch.float32)
    assert bool((values == 7.0).all())
    payload.verify(namespace=b"ns", dtype="float32", shape=cache.block_shape(1))
    assert cache._copy_stream is not None and cache._copy_stream != torch.cuda.default_stream(device)
    whole = cache.export_blocks([(5, 55)], b"ns")[0]  # no mark: after everything queued so far
    assert bytes(whole.data)[len(whole.data) // 2:] == bytes(payload.data)
    for _ in range(50):  # busy again: an import copies on the side stream, not behind this
        big = (big @ big).clamp_(-1, 1)
    cache.import_block(9, whole, b"ns")
    assert torch.equal(cache.kv[:, :, 9 * 16:10 * 16], cache.kv[:, :, 5 * 16:6 * 16])
