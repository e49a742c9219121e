"""How long the emulated model's answers are: a deterministic function of the prompt, which the emulated
runner (backends/models/emulated.py) acts out and the simulator computes the same way, so nobody else is
told (a client sends a cap, `max_tokens`, as real clients do; the conductor learns lengths from what it
sees end).

The emulated model writes only "answer tokens" (ANSWER_ALPHABET). Its answer to a context is the trailing
run of answer tokens; what comes before that run is the prompt proper, and its key is the sum of layer 0's
K over it (the integers the runner writes, KV_MODULUS below, read back from the KV cache, so the rule
holds wherever the KV came from: computed, imported from prefill, from the pool, or recomputed after a
migration). The key picks a total run length T from the model's output-length distribution (an inverse
CDF); the model writes EOS as the run's T-th token. A prompt that already ends in answer tokens has that
much of its run written: its answer is max(1, T - that) tokens, EOS included."""

from collections.abc import Sequence

import numpy as np

ANSWER_ALPHABET = "etaoin shrdlucmfwypvbgkq"  # what emulated text is made of, so streams are readable
KV_MODULUS = 251  # KV values are small integers: exact in every dtype, so digests never depend on it
_KEY_SALT = 0x5EED_1E76  # the length draw is independent of the token picks that share the key's inputs


def mix(*values: int) -> int:
    """A small integer hash (splitmix64 steps): the same on every host and Python build."""
    h = 0x9E3779B97F4A7C15
    for value in values:
        h = (h ^ (value & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h


def kv_cells(token_ids, positions):
    """Layer 0's K as the emulated runner writes it for tokens at positions (numpy or torch, elementwise)."""
    return (token_ids * 31 + positions * 7) % KV_MODULUS


class AnswerLengths:
    """An output-length distribution as an inverse CDF: `quantiles[i]` is the length at probability
    i / (len - 1), linear between."""

    def __init__(self, quantiles: Sequence[float]):
        values = [float(q) for q in quantiles]
        if len(values) < 2 or values[0] < 1 or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError("answer-length quantiles: at least two, the first >= 1, never decreasing")
        self.quantiles = values

    def total(self, key: int) -> int:
        """T: the answer run's total length for a prompt of key `key`."""
        u = mix(key, _KEY_SALT) / 2.0 ** 64 * (len(self.quantiles) - 1)
        i = min(int(u), len(self.quantiles) - 2)
        low, high = self.quantiles[i], self.quantiles[i + 1]
        return max(1, round(low + (u - i) * (high - low)))

    def of_prompt(self, prompt: Sequence[int], answer_ids: Sequence[int]) -> int:
        """Tokens the emulated model answers `prompt` with, EOS included (what the simulator charges)."""
        ids = np.asarray(prompt, dtype=np.int64)
        is_answer = np.isin(ids, np.asarray(answer_ids, dtype=np.int64))
        written = len(ids) - (int(np.flatnonzero(~is_answer)[-1]) + 1 if (~is_answer).any() else 0)
        proper = ids[:len(ids) - written]
        key = int(kv_cells(proper, np.arange(len(proper), dtype=np.int64)).sum())
        return max(1, self.total(key) - written)


def answer_token_ids() -> list[int]:
    """ANSWER_ALPHABET's ids in the byte-level tokenizer emulated models ship (mooncake/models/tiny.py):
    its vocabulary is the byte-level alphabet in sorted order."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_symbol = {b: s for s, b in zip(_bytes_to_unicode_symbols(), range(256))}
    return [alphabet.index(byte_symbol[ord(c)]) for c in ANSWER_ALPHABET]


def _bytes_to_unicode_symbols() -> list[str]:
    """GPT-2's byte-to-symbol table (what ByteLevel maps byte b to), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]
