"""The paged KV cache's tensor: [layer][k|v][slot][kv_head][head_dim], slot = block * block_size + offset.

Each layer's K (or V) is one contiguous [slots, kv_heads, head_dim] tensor, so the model writes new KV
with one index_copy_ per layer and gathers a sequence's context with one index_select. Export and
import move whole blocks (or one layer of them) as `KVPayload`s."""

from dataclasses import dataclass

import numpy as np
import torch

from mooncake.errors import KVPayloadError
from mooncake.hashing import checksum
from mooncake.kv_payload import KVPayload


@dataclass(frozen=True)
class KVSpec:
    """What a model needs stored per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * itemsize


class PagedKVCache:
    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.kv = torch.zeros(spec.num_layers, 2, num_blocks * block_size, spec.num_kv_heads, spec.head_dim,
                              dtype=dtype, device=device)

    def block_shape(self, layer: int | None = None) -> tuple[int, ...]:
        tail = (2, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return tail if layer is not None else (self.spec.num_layers, *tail)

    def _slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def export_block(self, block: int, block_hash: int, namespace: bytes, layer: int | None = None) -> KVPayload:
        view = self.kv[:, :, self._slots(block)] if layer is None else self.kv[layer, :, self._slots(block)]
        host = torch.empty(view.shape, dtype=view.dtype)  # one copy, never an alias of the live cache
        host.copy_(view)
        raw = memoryview(host.view(torch.uint8).numpy()).cast("B")
        return KVPayload(block_hash=block_hash, namespace=namespace, dtype=self.dtype_name,
                         shape=tuple(view.shape), layer=layer, checksum=checksum(raw), data=raw)

    def import_block(self, block: int, payload: KVPayload, namespace: bytes) -> None:
        """Verify `payload` and write it into `block` (all layers, or the payload's one layer)."""
        payload.verify(namespace=namespace, dtype=self.dtype_name, shape=self.block_shape(payload.layer))
        if payload.layer is not None and not 0 <= payload.layer < self.spec.num_layers:
            raise KVPayloadError(f"block {payload.block_hash:#x}: layer {payload.layer} out of range")
        slots = self._slots(block)
        target = self.kv[:, :, slots] if payload.layer is None else self.kv[payload.layer, :, slots]
        if target.device.type == "cpu":  # one copy, straight from the payload's bytes into the cache
            cells = target.view(torch.uint8).numpy()
            np.copyto(cells, np.frombuffer(payload.data, dtype=np.uint8).reshape(cells.shape))
            return
        values = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8).view(self.dtype).view(payload.shape)
        target.copy_(values.to(target.device))
