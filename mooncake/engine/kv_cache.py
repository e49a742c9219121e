"""The paged KV cache's tensor: [layer][k|v][slot][kv_head][head_dim], slot = block * block_size + offset.

Each layer's K (or V) is one contiguous [slots, kv_heads, head_dim] tensor, so the model writes new KV
with one index_copy_ per layer and gathers a sequence's context with one index_select. Export and
import move whole blocks (or one layer of them) as `KVPayload`s.

Export gathers its blocks into one tensor and copies that to host memory once. On CUDA it does so on a
side stream of its own, into pinned memory, after waiting only for the write it needs (`mark_written`,
an event the engine thread records as a layer's KV is written): the copy runs on the copy engine while
later layers compute, and the thread that asked waits for the copy alone."""

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
        self._copy_stream = None  # CUDA: the side stream exports copy on (made at the first)

    def block_shape(self, layer: int | None = None) -> tuple[int, ...]:
        tail = (2, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return tail if layer is not None else (self.spec.num_layers, *tail)

    def _slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def mark_written(self):
        """On the thread that writes the cache (the engine's), after a write: what an export of it must
        wait for. On CUDA an event on that thread's current stream (the write is only queued); elsewhere
        None (the write is done when it returns)."""
        if self.kv.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.kv.device))
        return event

    def export_block(self, block: int, block_hash: int, namespace: bytes, layer: int | None = None) -> KVPayload:
        return self.export_blocks([(block, block_hash)], namespace, layer)[0]

    def export_blocks(self, blocks: list[tuple[int, int]], namespace: bytes, layer: int | None = None,
                      after=None) -> list[KVPayload]:
        """Payloads of (block, hash) pairs, all layers or `layer` only, copied to host memory (never an
        alias of the live cache), a checksum each. Safe on any thread while no step writes these blocks.
        On CUDA the copy waits for `after` (`mark_written`), or with none for all work queued on the
        device's default stream so far."""
        if not blocks:
            return []
        shape = self.block_shape(layer)
        return [KVPayload(block_hash=block_hash, namespace=namespace, dtype=self.dtype_name, shape=shape,
                          layer=layer, checksum=checksum(raw), data=raw)
                for raw, (_, block_hash) in zip(self._to_host([block for block, _ in blocks], layer, after), blocks)]

    def _to_host(self, blocks: list[int], layer: int | None, after) -> list[memoryview]:
        if self.kv.device.type != "cuda":
            return self._copy_out(blocks, layer, pinned=False)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.kv.device)
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.default_stream(self.kv.device))
            hosts = self._copy_out(blocks, layer, pinned=True)
        stream.synchronize()  # this thread waits for its copies, not for the steps computing meanwhile
        return hosts

    def _copy_out(self, blocks: list[int], layer: int | None, pinned: bool) -> list[memoryview]:
        """Per block, the bytes of its KV ([layer][k|v][token][kv_head][dim], or [k|v]... for one layer) in
        new host memory, copied on the current stream; asynchronously into pinned memory when `pinned`."""
        spec = self.spec
        paged = self.kv.view(spec.num_layers, 2, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        if layer is None:  # NOTE: a copy per block: one pass over large blocks (a gather then a permute is two)
            hosts = []
            for block in blocks:
                host = torch.empty(self.block_shape(), dtype=self.dtype, pin_memory=pinned)
                host.copy_(paged[:, :, block], non_blocking=pinned)
                hosts.append(memoryview(host.view(torch.uint8).numpy()).cast("B"))
            return hosts
        # one layer: slices are small, so one gather of them all, then one copy to host
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        gathered = paged[layer].index_select(1, index).permute(1, 0, 2, 3, 4)
        host = torch.empty(gathered.shape, dtype=self.dtype, pin_memory=pinned)
        host.copy_(gathered, non_blocking=pinned)
        return [memoryview(row) for row in host.view(torch.uint8).numpy().reshape(len(blocks), -1)]

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
