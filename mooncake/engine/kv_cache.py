"""The paged KV cache's tensor: [layer][k|v][slot][kv_head][head_dim], slot = block * block_size + offset.

Each layer's K (or V) is one contiguous [slots, kv_heads, head_dim] tensor, so the model writes new KV
with one index_copy_ per layer and gathers a sequence's context with one index_select. Export and
import move whole blocks (or one layer of them) as `KVPayload`s.

Export gathers its blocks into one tensor and copies that to host memory once. On CUDA it does so on a
side stream of its own, into pinned memory, after waiting only for the write it needs (`mark_written`,
an event the engine thread records as a layer's KV is written): the copy runs on the copy engine while
later layers compute, and the thread that asked waits for the copy alone.

A CPP stage computes only its m of the model's L layers, so a whole block would waste (L - m) / L of its
memory on it. `stage_view(layers)` lends the stage the same memory as a cache of m layers with L // m times
as many blocks, each inside one of this cache's blocks (`StageView`)."""

from dataclasses import dataclass

import numpy as np
import torch

from mooncake.errors import KVPayloadError
from mooncake.kv_geometry import KVSpec
from mooncake.kv_payload import KVPayload


@dataclass(frozen=True)
class StageView:
    """The cache's memory as a cache of `layers` only (a CPP stage's, engine/stage.py): `kv` is
    [len(layers), 2, per_block * slots, kv_heads, head_dim], its [i] layer layers.start + i. Its block
    j * num_blocks + b (j < per_block) lies inside the cache's block b, so holding the cache's block b holds
    those per_block stage blocks (`blocks_in`)."""

    kv: torch.Tensor
    layers: range
    per_block: int
    num_blocks: int  # the cache's

    def blocks_in(self, cache_blocks: list[int], count: int) -> list[int]:
        """`count` stage blocks inside `cache_blocks` (at least ceil(count / per_block) of them), in order."""
        return [(i % self.per_block) * self.num_blocks + cache_blocks[i // self.per_block] for i in range(count)]


class PagedKVCache:
    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.kv = torch.zeros(spec.num_layers, 2, num_blocks * block_size, spec.num_kv_heads, spec.head_dim,
                              dtype=dtype, device=device)
        self._copy_stream = None  # CUDA: the side stream exports and imports copy on (made at the first)

    def block_shape(self, layer: int | None = None) -> tuple[int, ...]:
        tail = (2, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        return tail if layer is not None else (self.spec.num_layers, *tail)

    def _slots(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def stage_view(self, layers: range) -> StageView:
        """This cache's memory for a stage of `layers` (`StageView`). The flat memory is 2L half-planes (a
        layer's K or V) of every slot; stage layer i's K|V c of stage block j * num_blocks + b is half-plane
        (2i + c) * per_block + j at block b's slots, so the view is the first 2 * m * per_block half-planes,
        reshaped."""
        spec, m = self.spec, len(layers)
        per_block = spec.num_layers // m
        rows = 2 * m * per_block * self.num_blocks * self.block_size
        kv = self.kv.view(-1, spec.num_kv_heads, spec.head_dim)[:rows]
        return StageView(kv.view(m, 2, per_block * self.num_blocks * self.block_size, spec.num_kv_heads,
                                 spec.head_dim), layers, per_block, self.num_blocks)

    def mark_written(self):
        """On the thread that writes the cache (the engine's), after a write: what an export of it must
        wait for. On CUDA an event on that thread's current stream (the write is only queued); elsewhere
        None (the write is done when it returns)."""
        if self.kv.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.kv.device))
        return event

    def export_blocks(self, blocks: list[tuple[int, int]], namespace: bytes, layer: int | None = None,
                      after=None, view: StageView | None = None) -> list[KVPayload]:
        """Payloads of (block, hash) pairs, all layers or `layer` only, copied to host memory (never an
        alias of the live cache), a MAC each. Safe on any thread while no step writes these blocks.
        On CUDA the copy waits for `after` (`mark_written`), or with none for all work queued on the
        device's default stream so far. With `view`, the blocks are that stage view's, and `layer` one of
        its layers."""
        if not blocks:
            return []
        shape = self.block_shape(layer)
        hosts = self._to_host([block for block, _ in blocks], layer, after, view)
        return [KVPayload.of(block_hash, namespace, self.dtype_name, shape, layer, raw)
                for raw, (_, block_hash) in zip(hosts, blocks)]

    def _to_host(self, blocks: list[int], layer: int | None, after, view: StageView | None) -> list[memoryview]:
        if self.kv.device.type != "cuda":
            return self._copy_out(blocks, layer, pinned=False, view=view)
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.default_stream(self.kv.device))
            hosts = self._copy_out(blocks, layer, pinned=True, view=view)
        stream.synchronize()  # this thread waits for its copies, not for the steps computing meanwhile
        return hosts

    def _side_stream(self):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.kv.device)
        return self._copy_stream

    def _copy_in(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """Host `values` into device `target`, on the side stream, waited for. On the default stream the copy
        would queue behind the step in progress, so an import of n blocks would take n steps. No step reads
        `target` before the import is entered (kv_import.py), so nothing need wait for this copy but us."""
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            target.copy_(values.to(target.device))
        stream.synchronize()

    def _copy_out(self, blocks: list[int], layer: int | None, pinned: bool,
                  view: StageView | None = None) -> list[memoryview]:
        """Per block, the bytes of its KV ([layer][k|v][token][kv_head][dim], or [k|v]... for one layer) in
        new host memory, copied on the current stream; asynchronously into pinned memory when `pinned`."""
        spec = self.spec
        kv = self.kv if view is None else view.kv
        paged = kv.view(kv.shape[0], 2, -1, self.block_size, spec.num_kv_heads, spec.head_dim)
        if view is not None:
            if layer not in view.layers:
                raise ValueError(f"layer {layer} is not one of the stage's {view.layers}")
            layer -= view.layers.start
        if layer is None:  # NOTE: a copy per block: one pass over large blocks (a gather then a permute is two)
            hosts = []
            for block in blocks:
                host = torch.empty(self.block_shape(), dtype=self.dtype, pin_memory=pinned)
                host.copy_(paged[:, :, block], non_blocking=pinned)
                hosts.append(memoryview(host.view(torch.uint8).numpy()).cast("B"))
            return hosts
        # one layer: slices are small, so one gather of them all (in [block][k|v]... order), one copy to host
        index = torch.tensor(blocks, dtype=torch.long)
        if pinned:  # NOTE: a pageable copy to the device would hold this thread until `after` has fired
            index = index.pin_memory().to(self.kv.device, non_blocking=True)
        gathered = paged[layer].transpose(0, 1).index_select(0, index)
        host = torch.empty(gathered.shape, dtype=self.dtype, pin_memory=pinned)
        host.copy_(gathered, non_blocking=pinned)
        return [memoryview(row) for row in host.view(torch.uint8).numpy().reshape(len(blocks), -1)]

    def import_stage_block(self, view: StageView, block: int, payload: KVPayload, namespace: bytes) -> None:
        """Verify a whole-block `payload` (a cached prefix block, from the cache pool) and write the stage's
        layers of it into `view`'s block `block`."""
        payload.verify(namespace=namespace, dtype=self.dtype_name, shape=self.block_shape())
        layers = view.layers
        source = np.frombuffer(payload.data, dtype=np.uint8).reshape(self.spec.num_layers, -1)[layers.start:layers.stop]
        target = view.kv.view(len(layers), 2, -1, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)[:, :, block]
        if target.device.type == "cpu":  # one copy, straight from the payload's bytes into the cache
            cells = target.view(torch.uint8).numpy()
            np.copyto(cells, source.reshape(cells.shape))
            return
        self._copy_in(target, torch.from_numpy(source.copy()).view(self.dtype).view(target.shape))

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
        self._copy_in(target, torch.frombuffer(bytearray(payload.data), dtype=torch.uint8).view(self.dtype)
                      .view(payload.shape))
