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
    input_ids, positions, logits_indices, sampled = [], [], [], []
    decodes = [s for s in scheduled if s.num_new_tokens == 1]
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    tables = [torch.tensor(s.seq.block_table, dtype=torch.long) for s in decodes + prefills]
    slot_mapping = []
    for item, table in zip(decodes + prefills, tables):
        start = item.seq.num_computed_tokens
        input_ids.extend(item.seq.token_slice(start, start + item.num_new_tokens))
        item_positions = torch.arange(start, start + item.num_new_tokens)
        positions.append(item_positions)
        slot_mapping.append(_slots(table, item_positions, block_size))
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(item.seq)

    decode_slots = decode_mask = None
    if decodes:
        lengths = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes])
        max_len = int(lengths.max())
        max_blocks = (max_len + block_size - 1) // block_size
        padded = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, table in enumerate(tables[:len(decodes)]):
            n = min(len(table), max_blocks)
            padded[i, :n] = table[:n]
        pos = torch.arange(max_len)
        decode_slots = padded[:, pos // block_size] * block_size + pos % block_size
        if int(lengths.min()) < max_len:  # additive mask, built once per step for every layer
            decode_mask = torch.zeros(len(decodes), 1, 1, max_len, dtype=dtype)
            decode_mask.masked_fill_((pos[None, :] >= lengths[:, None])[:, None, None, :], float("-inf"))

    spans, offset = [], len(decodes)
    for item, table in zip(prefills, tables[len(decodes):]):
        context_len = item.seq.num_computed_tokens + item.num_new_tokens
        context = _slots(table, torch.arange(context_len), block_size)
        spans.append(PrefillSpan(start=offset, num_tokens=item.num_new_tokens, context_slots=context.to(device)))
        offset += item.num_new_tokens

    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device),
        slot_mapping=torch.cat(slot_mapping).to(device),
        num_decode=len(decodes),
        decode_context_slots=None if decode_slots is None else decode_slots.to(device),
        decode_mask=None if decode_mask is None else decode_mask.to(device),
        prefills=tuple(spans),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
    )
    return batch, sampled


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size

