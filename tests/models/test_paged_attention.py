"""The paged decode attention kernel (backends/kernels/paged_attention.c) against torch's SDPA over the
same contexts gathered by hand: every code path of the kernel (rows as items or split by KV head, head
sizes it specialises and one it does not, power-of-two block sizes and not, GQA and MHA)."""

import pytest
import torch

from backends.kernels import paged_attention

kernel = paged_attention.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler here: the model gathers instead")


def _case(rows: int, heads: int, kv_heads: int, dim: int, block_size: int, lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = rows * max_blocks + 3
    kv = torch.randn(2, num_blocks * block_size, kv_heads, dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    # each row's blocks scattered over the cache, in no order; padding entries point at block 0
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(rows, max_blocks, dtype=torch.long)
    for row, n in enumerate(lens):
        used = -(-n // block_size)
        table[row, :used] = order[row * max_blocks:row * max_blocks + used]
    return q, kv, table, torch.tensor(lens)


@pytest.mark.parametrize("rows,heads,kv_heads,dim,block_size", [
    (1, 9, 3, 64, 64),     # one row: split by KV head
    (12, 9, 3, 64, 64),    # many rows: a row per item
    (12, 8, 8, 128, 16),   # MHA, 128-wide heads
    (5, 4, 1, 40, 48),     # a head size it does not specialise, a block size that is not a power of two
])
def test_the_kernel_equals_sdpa_over_the_gathered_context(rows, heads, kv_heads, dim, block_size):
    lens = [(7 * i * block_size) // 3 % (4 * block_size) + 1 for i in range(rows)]
    lens[0] = 4 * block_size  # a context that ends exactly at a block's end
    q, kv, table, lens_t = _case(rows, heads, kv_heads, dim, block_size, lens, seed=rows + dim)
    got = kernel.attend(q, kv, table, lens_t, block_size)
    want = paged_attention.reference(q, kv, table, lens_t, block_size)
    assert got.shape == (rows, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_token_beyond_a_rows_length_changes_nothing():
    q, kv, table, lens = _case(3, 6, 2, 64, 16, [20, 33, 5], seed=7)
    before = kernel.attend(q, kv, table, lens, 16)
    slot = int(table[0, 1]) * 16 + 4  # row 0's 21st token: past its 20
    kv[:, slot] = 1e6
    torch.testing.assert_close(kernel.attend(q, kv, table, lens, 16), before)
    lens[0] = 21  # ... and read once it is part of the context
    assert not torch.allclose(kernel.attend(q, kv, table, lens, 16)[0], before[0])


def test_a_head_size_it_cannot_take_is_an_error_naming_it():
    q, kv, table, lens = _case(2, 4, 2, 12, 16, [5, 9], seed=3)
    with pytest.raises(ValueError, match="12"):
        kernel.attend(q, kv, table, lens, 16)


def test_a_kernel_directory_others_may_write_is_refused(tmp_path, monkeypatch):
    """Loading the built library runs its code: one in a directory another user could write is not loaded
    (decode gathers instead, and the log says why)."""
    home = tmp_path / "home"
    (home / "kernels").mkdir(parents=True)
    (home / "kernels").chmod(0o777)
    monkeypatch.setenv("MOONCAKE_HOME", str(home))
    monkeypatch.setattr(paged_attention, "_library", None)
    assert paged_attention.load() is None
    assert not list((home / "kernels").iterdir())  # nothing built or loaded there
    (home / "kernels").chmod(0o700)
    monkeypatch.setattr(paged_attention, "_library", None)
    assert paged_attention.load() is not None
