"""A Llama layer's residual add + RMSNorm, and its RoPE + KV-cache write, each one C call on a CPU in float32
(fused_ops.c, built at first use by build.py): at a decode step's few rows, torch's dispatch of the four to
eight operations each takes costs more than their arithmetic. Where there is no compiler, or the built
kernel disagrees with torch's operations on a check at load, the model keeps torch's and the log says why."""

import ctypes
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.kernels import build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class FusedOps:
    def __init__(self, library: ctypes.CDLL):
        self._norm = library.add_rms_norm
        self._norm.restype = None
        self._norm.argtypes = [_ptr] * 4 + [_i64, _i64, ctypes.c_float, ctypes.c_int]
        self._rope = library.rope_store
        self._rope.restype = ctypes.c_int
        self._rope.argtypes = [_ptr] * 8 + [_i64] * 6 + [ctypes.c_int]

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """hidden += delta in place (when given); returns RMSNorm(hidden) * weight. hidden and delta
        [rows, dim], contiguous."""
        if delta is not None:
            delta = delta.contiguous()  # NOTE: held here, not a temporary: C reads it after data_ptr() returns
            _check_floats(delta)
        _check_floats(hidden, weight)
        rows, dim = hidden.shape
        if weight.shape != (dim,) or (delta is not None and delta.shape != hidden.shape):
            raise ValueError(f"hidden {tuple(hidden.shape)}, delta {None if delta is None else tuple(delta.shape)} "
                             f"and weight {tuple(weight.shape)} do not match")
        out = torch.empty_like(hidden)
        self._norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), rows, dim, eps, torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, kv_layer: torch.Tensor, heads: int) -> torch.Tensor:
        """Rotated q [rows, heads, d] from qkv [rows, (heads + 2 kv_heads) d]; rotated k and v written into
        kv_layer [2, slots, kv_heads, d] at `slots`. cos, sin [max_positions, d]; positions, slots int64."""
        _check_floats(qkv, cos, sin, kv_layer)
        rows = qkv.shape[0]
        num_slots, kv_heads, dim = kv_layer.shape[1:]
        if qkv.shape[1] != (heads + 2 * kv_heads) * dim or cos.shape != sin.shape or cos.shape[1] != dim:
            raise ValueError(f"q|k|v rows of {qkv.shape[1]}, cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do "
                             f"not fit {heads} heads and {kv_heads} KV heads of {dim}")
        q = qkv.new_empty(rows, heads, dim)
        positions, slots = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        if positions.shape != (rows,) or slots.shape != (rows,):
            raise ValueError(f"{rows} rows of q|k|v take as many positions and slots, not {tuple(positions.shape)} "
                             f"and {tuple(slots.shape)}")
        failed = self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                            q.data_ptr(), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(), rows, heads, kv_heads,
                            dim, cos.shape[0], num_slots, torch.get_num_threads())
        if failed:
            raise IndexError(f"a position (at most {int(positions.max())}) or a KV slot (at most "
                             f"{int(slots.max())}) is out of its table ({cos.shape[0]} positions, {num_slots} slots)")
        return q


def _check_floats(*tensors: torch.Tensor) -> None:
    """The C code reads raw float32 memory: anything else is a caller's bug, raised before it is read."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"the fused layer ops take contiguous float32 CPU tensors, not {t.dtype} on "
                             f"{t.device} (contiguous: {t.is_contiguous()})")


def load() -> FusedOps | None:
    """The kernels, built if needed and checked against torch's operations; None where they cannot be had
    (the log says why)."""
    global _library
    if _library is None:
        _library = build.load_library(SOURCE, "fused layer ops", "the layers run torch's operations")
    if not _library:
        return None
    ops = FusedOps(_library)
    mismatch = _check(ops)
    if mismatch is not None:
        log.warning("the fused layer ops disagree with torch's (max difference %g); using torch's", mismatch)
        return None
    return ops


_library: ctypes.CDLL | bool | None = None  # None: not tried yet; False: tried, unavailable


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE by torch's operations (where the kernel is not used): x [n, heads, d], cos and sin
    [n, d] (the tokens' rows)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _check(ops: FusedOps) -> float | None:
    """None when both kernels agree with torch on a small random case, else the largest difference."""
    gen = torch.Generator().manual_seed(0)
    rows, dim, heads, kv_heads, d = 3, 40, 4, 2, 16
    hidden, delta, weight = (torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen),
                             torch.randn(dim, generator=gen))
    want_hidden = hidden + delta
    want = F.rms_norm(want_hidden, (dim,), weight, 1e-5)
    got = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    diffs = [(got - want).abs().max().item(), (hidden - want_hidden).abs().max().item()]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    cos, sin = torch.randn(9, d, generator=gen), torch.randn(9, d, generator=gen)
    positions, slots = torch.tensor([4, 0, 8]), torch.tensor([5, 1, 2])
    kv = torch.zeros(2, 6, kv_heads, d)
    q = ops.rope_store(qkv, cos, sin, positions, slots, kv, heads)
    x = qkv.view(rows, heads + 2 * kv_heads, d)
    rotated = rope(x[:, :heads + kv_heads], cos[positions], sin[positions])
    diffs += [(q - rotated[:, :heads]).abs().max().item(), (kv[0, slots] - rotated[:, heads:]).abs().max().item(),
              (kv[1, slots] - x[:, heads + kv_heads:]).abs().max().item()]
    return None if max(diffs) <= 1e-4 else max(diffs)
