"""Turns logits into next tokens: greedy rows in one argmax, sampled rows each with their own RNG; and,
for the rows that ask, the chosen tokens' log-probabilities. A row whose distribution is not finite (NaN
logits, or a temperature that overflows them) gets no token: that sequence fails alone, not the batch."""

import torch

from mooncake.engine.sequence import Sequence
from mooncake.sampling import TokenLogprob


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | None]:
    """logits: float32 [len(seqs), vocab]; returns one token id per sequence, or None where the sequence's
    distribution is not finite (it cannot be sampled)."""
    chosen = logits.argmax(dim=-1)
    # NOTE: argmax propagates NaN, so one gather of B values finds every greedy row with NaN logits.
    is_nan = torch.isnan(logits.gather(1, chosen.unsqueeze(1))).squeeze(1).tolist()
    tokens: list[int | None] = chosen.tolist()
    for i, seq in enumerate(seqs):
        if is_nan[i]:
            tokens[i] = None
        elif not seq.params.is_greedy:
            tokens[i] = _sample_one(logits[i], seq)
    return tokens


def logprobs_of(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    """Each chosen token's log-probability under the raw distribution (as vLLM reports by default) and
    its sequence's `logprobs` likeliest alternatives; None for sequences that did not ask. One
    log-softmax over the rows that asked."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logp[torch.arange(len(rows)), torch.tensor([tokens[i] for i in rows])].tolist()
    k = max(seqs[i].params.logprobs for i in rows)
    values, ids = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
    values, ids = values.tolist(), ids.tolist()
    for row, i in enumerate(rows):
        want = seqs[i].params.logprobs
        out[i] = TokenLogprob(chosen[row], list(zip(ids[row][:want], values[row][:want])))
    return out


def prompt_logprobs_of(logits: torch.Tensor, rows: list) -> list[list[TokenLogprob]]:
    """Per `PromptRows` (mooncake/engine/batch.py) of `logits`, the log-probability and rank of each prompt
    token its rows predict, with its sequence's `prompt_logprobs` likeliest alternatives."""
    out = []
    for r in rows:
        logp = torch.log_softmax(logits[r.row:r.row + r.count].float(), dim=-1)
        targets = torch.tensor(r.seq.prompt_token_ids[r.first + 1:r.first + 1 + r.count], device=logp.device)
        chosen = logp.gather(1, targets[:, None])
        ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
        k = r.seq.params.prompt_logprobs
        values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        out.append([TokenLogprob(lp, list(zip(i, v)), rank)
                    for lp, i, v, rank in zip(chosen[:, 0].tolist(), ids.tolist(), values.tolist(), ranks)])
    return out


def _sample_one(logits: torch.Tensor, seq: Sequence) -> int | None:
    params = seq.params
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if not bool(torch.isfinite(probs).all()):
        return None
    return int(torch.multinomial(probs, 1, generator=seq.generator).item())
