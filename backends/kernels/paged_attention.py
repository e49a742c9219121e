"""Decode attention over the paged KV cache on a CPU, without gathering K and V: a small C kernel
(paged_attention.c) that reads each row's context block by block through its block table.

No maintained library has one for this torch on a CPU: torch's own paged attention (flex_attention with a
paged block mask, compiled by inductor) measured no faster than gather + SDPA at batch 32 and 300 tokens of
context (6.2 vs 6.3 ms a layer), and Intel's extension is not built for this torch. The kernel is compiled
at first use (build.py). Where there is no compiler, or the built kernel disagrees with torch's attention
on a check at load, the model keeps the gather path and the log says why."""

import ctypes
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.kernels import build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
_i64, _f32p = ctypes.c_int64, ctypes.POINTER(ctypes.c_float)


class PagedDecodeAttention:
    """The loaded kernel: `attend(q, kv_layer, table, lens, block_size)` is softmax(q K^T / sqrt(d)) V per
    row over that row's first lens[row] context tokens, read through its block table."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = library.paged_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [_i64] * 6 + [ctypes.c_float, ctypes.c_int]

    def attend(self, q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
               block_size: int) -> torch.Tensor:
        """q [rows, heads, d] float32; kv_layer [2, slots, kv_heads, d], contiguous, slot = block *
        block_size + offset; table [rows, max_blocks] int64; lens [rows] int64. Returns [rows, heads, d]."""
        rows, heads, dim = q.shape
        q, table, lens = q.contiguous(), table.contiguous(), lens.contiguous()
        out = torch.empty_like(q)
        failed = self._fn(q.data_ptr(), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(), table.data_ptr(),
                          lens.data_ptr(), out.data_ptr(), rows, heads, kv_layer.shape[2], dim, block_size,
                          table.shape[1], 1.0 / math.sqrt(dim), torch.get_num_threads())
        if failed == -1:
            raise MemoryError("paged decode attention could not allocate its scratch memory")
        if failed:
            raise ValueError(f"paged decode attention takes head sizes that are a multiple of 8 and a whole "
                             f"number of query heads per KV head, not {dim} and {heads}/{kv_layer.shape[2]}")
        return out


def load() -> PagedDecodeAttention | None:
    """The kernel, built if needed and checked against torch's attention; None where it cannot be had (the
    log says why)."""
    global _library
    if _library is None:
        _library = build.load_library(SOURCE, "paged attention", "decode attention gathers K and V")
    if not _library:
        return None
    kernel = PagedDecodeAttention(_library)
    mismatch = _check(kernel)
    if mismatch is not None:
        log.warning("the paged attention kernel disagrees with torch's attention (max difference %g); using "
                    "gather + SDPA", mismatch)
        return None
    return kernel


_library: ctypes.CDLL | bool | None = None  # None: not tried yet; False: tried, unavailable


def reference(q: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
              block_size: int) -> torch.Tensor:
    """The same attention by torch's SDPA, one row at a time (for the load check and the tests)."""
    heads, kv_heads = q.shape[1], kv_layer.shape[2]
    outs = []
    for row in range(q.shape[0]):
        length = int(lens[row])
        slots = (table[row, :, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
        k, v = kv_layer.index_select(1, slots).transpose(1, 2)  # [kv_heads, length, d] each
        o = F.scaled_dot_product_attention(q[row].view(kv_heads, heads // kv_heads, 1, -1), k[:, None],
                                           v[:, None])
        outs.append(o.reshape(heads, -1))
    return torch.stack(outs)


def _check(kernel: PagedDecodeAttention) -> float | None:
    """None when the kernel agrees with `reference` on a small random case (rows of different lengths,
    blocks out of order, GQA), else the largest difference."""
    gen = torch.Generator().manual_seed(0)
    bs, rows, heads, kv_heads, dim, num_blocks = 16, 3, 6, 2, 64, 8
    kv = torch.randn(2, num_blocks * bs, kv_heads, dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:rows * 2].view(rows, 2)
    lens = torch.tensor([2 * bs, bs + 1, 1])
    diff = (kernel.attend(q, kv, table, lens, bs) - reference(q, kv, table, lens, bs)).abs().max().item()
    return None if diff <= 1e-4 else diff
