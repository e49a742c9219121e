"""Turns the scheduler's choice for one step into a `ForwardBatch` of tensors."""

from dataclasses import dataclass

import torch

from mooncake.engine.runner import DecodeGroup, ForwardBatch, PrefillSpan
from mooncake.engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class PromptRows:
    """Logits rows [row, row + count) of a batch are positions [first, first + count) of `seq`'s prompt:
    row k gives the log-probability of prompt token first + k + 1 (`Sequence.wants_prompt_logprobs`)."""

    seq: Sequence
    row: int
    first: int
    count: int


def build_batch(scheduled: list[ScheduledSeq], block_size: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> tuple[ForwardBatch, list[Sequence], list[PromptRows]]:
    """The step's batch, the sequences whose next token the returned logits give (their rows first, in
    row order), and the rows after those that give prompt tokens' logprobs."""
    input_ids, logits_indices, sampled, prompt_rows = [], [], [], []
    # NOTE: decodes longest context first, so rows of close lengths sit together (decode_groups).
    decodes = sorted((s for s in scheduled if s.num_new_tokens == 1), key=lambda s: -s.seq.num_computed_tokens)
    prefills = [s for s in scheduled if s.num_new_tokens > 1]
    # NOTE: a decode's one new token is placed with plain ints; tensors per sequence cost more than the
    # arithmetic they would do (a step may batch hundreds of decodes).
    positions = [s.seq.num_computed_tokens for s in decodes]
    slots = [s.seq.block_table[p // block_size] * block_size + p % block_size for s, p in zip(decodes, positions)]
    prompt_indices = []
    for item in decodes:  # NOTE: a prompt's chunk may be one token when the step's budget was nearly spent
        _prompt_rows(item, len(input_ids), prompt_rows, prompt_indices)
        input_ids.append(item.seq.token_slice(item.seq.num_computed_tokens, item.seq.num_computed_tokens + 1)[0])
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(item.seq)
    prefill_tables = [torch.tensor(s.seq.block_table, dtype=torch.long) for s in prefills]
    prefill_positions = []
    for item, table in zip(prefills, prefill_tables):
        start = item.seq.num_computed_tokens
        _prompt_rows(item, len(input_ids), prompt_rows, prompt_indices)
        input_ids.extend(item.seq.token_slice(start, start + item.num_new_tokens))
        item_positions = torch.arange(start, start + item.num_new_tokens)
        prefill_positions.append(item_positions)
        slots.extend(_slots(table, item_positions, block_size).tolist())
        if item.samples:
            logits_indices.append(len(input_ids) - 1)
            sampled.append(item.seq)

    lengths = [p + 1 for p in positions]
    groups = tuple(_decode_group(decodes, lengths, start, stop, block_size, device, dtype)
                   for start, stop in _by_length(lengths))

    spans, offset = [], len(decodes)
    for item, table in zip(prefills, prefill_tables):
        context_len = item.seq.num_computed_tokens + item.num_new_tokens
        context = _slots(table, torch.arange(context_len), block_size)
        spans.append(PrefillSpan(start=offset, num_tokens=item.num_new_tokens, context_slots=context.to(device)))
        offset += item.num_new_tokens

    prompt_rows = [PromptRows(r.seq, r.row + len(sampled), r.first, r.count) for r in prompt_rows]
    logits_indices += prompt_indices
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.cat([torch.tensor(positions, dtype=torch.long)] + prefill_positions).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode=len(decodes),
        decode_groups=groups,
        prefills=tuple(spans),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
    )
    return batch, sampled, prompt_rows


def _prompt_rows(item: ScheduledSeq, offset: int, rows: list[PromptRows], indices: list[int]) -> None:
    """The rows of `item`'s positions (from `offset` in the flat batch) whose next token is a prompt token,
    when its prompt's logprobs are wanted."""
    start = item.seq.num_computed_tokens
    count = min(start + item.num_new_tokens, len(item.seq.prompt_token_ids) - 1) - start
    if item.seq.wants_prompt_logprobs and count > 0:
        rows.append(PromptRows(item.seq, len(indices), start, count))
        indices.extend(range(offset, offset + count))


PAD_SHARE = 0.25  # a decode row joins a group if padding it to the group's longest is within this share
PAD_TOKENS = 256  # ... or within this many tokens (small contexts batch whole)


def _by_length(lengths: list[int]) -> list[tuple[int, int]]:
    """Row ranges of close context lengths, `lengths` in descending order: each range's rows are padded to
    its first (longest), wasting at most PAD_SHARE of it or PAD_TOKENS."""
    ranges, start = [], 0
    for i, length in enumerate(lengths):
        if lengths[start] - length > max(PAD_SHARE * lengths[start], PAD_TOKENS):
            ranges.append((start, i))
            start = i
    if lengths:
        ranges.append((start, len(lengths)))
    return ranges


def _decode_group(decodes: list[ScheduledSeq], lengths: list[int], start: int, stop: int, block_size: int,
                  device: torch.device, dtype: torch.dtype) -> DecodeGroup:
    max_len = lengths[start]
    max_blocks = (max_len + block_size - 1) // block_size
    tables = [decodes[i].seq.block_table[:max_blocks] for i in range(start, stop)]
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    slots = (padded[:, :, None] * block_size + torch.arange(block_size)).reshape(stop - start, -1)[:, :max_len]
    mask = None
    if lengths[stop - 1] < max_len:  # additive mask, built once per step for every layer
        real = torch.tensor(lengths[start:stop])
        mask = torch.zeros(stop - start, 1, 1, max_len, dtype=dtype)
        mask.masked_fill_((torch.arange(max_len)[None, :] >= real[:, None])[:, None, None, :], float("-inf"))
        mask = mask.to(device)
    return DecodeGroup(start, stop, slots.contiguous().to(device), mask, padded.to(device), block_size,
                       torch.tensor(lengths[start:stop], dtype=torch.long, device=device))


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size

