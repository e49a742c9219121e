"""The model-runner contract: what the engine asks of a model backend (backends/models/).

Caller: `LLMEngine.step()` calls `forward()` once per step with a `ForwardBatch` that mixes decode tokens
and prefill chunks of many sequences; the runner writes their new KV into the paged cache and returns
logits for the tokens listed in `logits_indices`. `kv_spec` sizes the cache at start-up."""

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mooncake.kv_geometry import KVSpec
from mooncake.errors import UnsupportedModelError

if TYPE_CHECKING:
    from mooncake.engine.modelled_time import ModelledTime


@dataclass(frozen=True)
class PrefillSpan:
    """A run of `num_tokens` consecutive tokens of one sequence (a prefill chunk) in the flat batch."""

    start: int  # offset in the flat batch
    num_tokens: int
    context_slots: torch.Tensor  # [context_len] cache slots of all its tokens so far, new ones included


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, stop) whose contexts are close in length: gathered and attended together,
    padded only to the longest of them (one long context does not pad every row of the batch)."""

    start: int
    stop: int
    context_slots: torch.Tensor  # [rows, max_context] padded context slots
    mask: torch.Tensor | None  # [rows, 1, 1, max_context] additive: 0 real, -inf padding; None: no padding
    # [rows, ceil(max_context / block_size)] the same contexts as blocks (padded with block 0): gathering whole
    # blocks moves the same bytes in far fewer, larger copies than gathering slots
    block_table: torch.Tensor | None = None
    block_size: int = 0
    context_lens: torch.Tensor | None = None  # [rows] int64: each row's context length, its new token included


@dataclass(frozen=True)
class ForwardBatch:
    """One step's work as plain tensors; the flat token order is decode tokens first, then prefill spans."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] where each token's new KV goes
    num_decode: int  # the first num_decode tokens each belong to a different sequence
    decode_groups: tuple["DecodeGroup", ...]  # the decode rows, by context length, in row order
    prefills: tuple[PrefillSpan, ...]
    logits_indices: torch.Tensor  # [num_sampled] flat indices whose logits are returned


class ModelRunner(ABC):
    """A model forward pass over the paged KV cache."""

    kv_spec: KVSpec
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    modelled: "ModelledTime | None" = None
    """A runner that emulates hardware: what its steps, KV and hidden states would take there (the engine
    waits that out; its forward returns at once). None for a real runner, whose steps take what they take."""

    @classmethod
    def from_engine_config(cls, model_dir, device: torch.device, dtype: torch.dtype, config) -> "ModelRunner":
        """This backend for an engine of `config` (an EngineConfig); backends with settings of their own
        (the emulated runner's speedup) override this."""
        return cls(model_dir, device, dtype)

    def forward_stage(self, batch: ForwardBatch, kv: torch.Tensor, layers: range,
                      hidden: torch.Tensor | None) -> torch.Tensor:
        """One stage of chunked pipeline parallelism (CPP, mooncake/engine/stage.py): compute only layers
        `layers` (a contiguous range) of the batch, writing only their KV into `kv`, the stage's cache
        ([len(layers), 2, slots, kv_heads, head_dim]: kv[i] is layer layers.start + i), from the previous stage's
        `hidden` states ([num_tokens, ...], as the previous stage returned them; None for the first
        stage, which embeds input_ids). Returns the hidden states after layers.stop - 1 for the next stage,
        or, when layers.stop is the last layer, float32 logits as `forward` does."""
        raise UnsupportedModelError(f"the {type(self).__name__} model backend cannot run CPP pipeline stages")

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Write the batch's new KV into `kv` ([layers, 2, slots, kv_heads, head_dim]) and return
        float32 logits [len(batch.logits_indices), vocab_size]. `on_layer(i)`, where given, is called as
        soon as layer i's new KV is in `kv`, before layer i + 1 computes (layer-wise KV streaming). An
        emulated runner (`modelled`) is not given one: the engine hands each layer on at its modelled end."""
