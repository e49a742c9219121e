"""Turns the scheduler's choice for one step into a `ForwardBatch` of tensors."""

from dataclasses import dataclass

import torch

from mooncake.engine.runner import ForwardBatch, PrefillSpan
from mooncake.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


def build_batch(scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> tuple[ForwardBatch, list[Sequence]]:
    """The step's batch, and the sequences whose next token the returned logits give, in row order."""
    input_ids, logits_indices, sampled = [], [], []
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    # NOTE: a decode's one new token is placed with plain ints; tensors per sequence cost more than the
    # arithmetic they would do (a step may batch hundreds of decodes).
    positions = [s.seq.num_computed_tokens for s in decodes]
    slots = [s.seq.block_table[p // block_size] * block_size + p % block_size for s, p in zip(decodes, positions)]
    for item in decodes:
        input_ids.append(item.seq.token_slice(item.seq.num_computed_tokens, item.seq.num_computed_tokens + 1)[0])
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(item.seq)
    prefill_tables = [torch.tensor(s.seq.block_table, dtype=torch.long) for s in prefills]
    prefill_positions = []
    for item, table in zip(prefills, prefill_tables):
        start = item.seq.num_computed_tokens
        input_ids.extend(item.seq.token_slice(start, start + item.num_new_tokens))
        item_positions = torch.arange(start, start + item.num_new_tokens)
        prefill_positions.append(item_positions)
        slots.extend(_slots(table, item_positions, block_size).tolist())
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(item.seq)

    decode_slots = decode_mask = None
    if decodes:
        lengths = torch.tensor(positions) + 1
        max_len = int(lengths.max())
        max_blocks = (max_len + block_size - 1) // block_size
        padded = torch.tensor([s.seq.block_table[:max_blocks] + [0] * (max_blocks - len(s.seq.block_table[:max_blocks]))
                               for s in decodes], dtype=torch.long)
        within = torch.arange(block_size)
        decode_slots = (padded[:, :, None] * block_size + within).reshape(len(decodes), -1)[:, :max_len].contiguous()
        if int(lengths.min()) < max_len:  # additive mask, built once per step for every layer
            pos = torch.arange(max_len)
            decode_mask = torch.zeros(len(decodes), 1, 1, max_len, dtype=dtype)
            decode_mask.masked_fill_((pos[None, :] >= lengths[:, None])[:, None, None, :], float("-inf"))

    spans, offset = [], len(decodes)
    for item, table in zip(prefills, prefill_tables):
        context_len = item.seq.num_computed_tokens + item.num_new_tokens
        context = _slots(table, torch.arange(context_len), block_size)
        spans.append(PrefillSpan(start=offset, num_tokens=item.num_new_tokens, context_slots=context.to(device)))
        offset += item.num_new_tokens

    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.cat([torch.tensor(positions, dtype=torch.long)] + prefill_positions).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode=len(decodes),
        decode_context_slots=None if decode_slots is None else decode_slots.to(device),
        decode_mask=None if decode_mask is None else decode_mask.to(device),
        prefills=tuple(spans),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
    )
    return batch, sampled


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size

