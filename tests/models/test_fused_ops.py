"""The fused layer ops (backends/kernels/fused_ops.c) against torch's operations: the residual add +
RMSNorm, and RoPE + the KV-cache write, on decode-sized and prefill-sized row counts (one thread and
several), with grouped-query heads; a position or slot out of its table is an error, never a stray write."""

import pytest
import torch
import torch.nn.functional as F

from backends.kernels import fused_ops

ops = fused_ops.load()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler here")


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_is_the_residual_add_then_torchs_rms_norm(rows):
    gen = torch.Generator().manual_seed(rows)
    hidden, delta = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    want_hidden = hidden + delta
    got = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=0)  # added in place, exactly
    torch.testing.assert_close(got, F.rms_norm(want_hidden, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    before = hidden.clone()
    got = ops.add_rms_norm(hidden, None, weight, 1e-5)  # no residual: the norm alone, hidden untouched
    assert torch.equal(hidden, before)
    torch.testing.assert_close(got, F.rms_norm(before, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rope_store_rotates_q_and_k_and_writes_k_and_v_at_their_slots(rows):
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, d, num_slots, max_pos = 9, 3, 64, 512, 1024
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    cos, sin = torch.randn(max_pos, d, generator=gen), torch.randn(max_pos, d, generator=gen)
    positions = torch.randint(0, max_pos, (rows,), generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:rows]
    kv = torch.zeros(2, num_slots, kv_heads, d)
    q = ops.rope_store(qkv, cos, sin, positions, slots, kv, heads)
    x = qkv.view(rows, heads + 2 * kv_heads, d)
    rotated = fused_ops.rope(x[:, :heads + kv_heads], cos[positions], sin[positions])
    torch.testing.assert_close(q, rotated[:, :heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv[0, slots], rotated[:, heads:], rtol=1e-5, atol=1e-5)
    assert torch.equal(kv[1, slots], x[:, heads + kv_heads:])
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not kv[:, untouched].any()  # nothing written elsewhere


def test_a_position_or_slot_out_of_its_table_is_an_error_and_writes_nothing_there():
    heads, kv_heads, d = 2, 1, 16
    qkv = torch.randn(1, (heads + 2 * kv_heads) * d)
    cos = sin = torch.ones(8, d)
    kv = torch.zeros(2, 4, kv_heads, d)
    with pytest.raises(IndexError, match="8 positions, 4 slots"):
        ops.rope_store(qkv, cos, sin, torch.tensor([8]), torch.tensor([0]), kv, heads)
    with pytest.raises(IndexError, match="slot"):
        ops.rope_store(qkv, cos, sin, torch.tensor([0]), torch.tensor([4]), kv, heads)
    assert not kv.any()


def test_tensors_the_c_code_cannot_read_as_they_are_are_refused_before_it_reads_them():
    hidden, weight = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="float32"):
        ops.add_rms_norm(hidden.double(), None, weight, 1e-5)
    with pytest.raises(ValueError, match="contiguous: False"):
        ops.add_rms_norm(torch.randn(8, 4).t(), None, weight, 1e-5)
    with pytest.raises(ValueError, match="do not match"):
        ops.add_rms_norm(hidden, torch.randn(3, 8), weight, 1e-5)
    got = ops.add_rms_norm(hidden.clone(), torch.randn(8, 4).t(), weight, 1e-5)  # a strided delta is copied
    assert got.shape == (4, 8)
    kv, qkv = torch.zeros(2, 4, 1, 16), torch.randn(2, 4 * 16)
    with pytest.raises(ValueError, match="positions and slots"):
        ops.rope_store(qkv, torch.ones(8, 16), torch.ones(8, 16), torch.tensor([0]), torch.tensor([0, 1]), kv, 2)
    with pytest.raises(ValueError, match="do not fit"):
        ops.rope_store(qkv, torch.ones(8, 16), torch.ones(8, 16), torch.tensor([0, 1]), torch.tensor([0, 1]), kv, 3)
