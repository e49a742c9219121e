"""Structured outputs in the engine. A request's grammar (`SamplingParams.grammar`: llguidance's format,
which the API builds from a JSON schema, a regex, a list of choices or a Lark grammar) masks its logits at
every token it samples: prefill's first, then each decode step. A matcher per sequence follows its output;
a leg that resumes after tokens already generated (decode after prefill's hand-off, a migration) has them at
the end of its prompt and replays them first (`SamplingParams.grammar_done`). Log-probabilities stay those of
the raw distribution: the mask changes what is sampled, not what is reported.

llguidance (MIT; a Rust core, no other dependency, masks computed on the CPU whatever the device) is the
grammar engine vLLM's and SGLang's "guidance" backends use."""

import threading

import llguidance
import torch

from mooncake.errors import InvalidRequestError

_BITS = torch.arange(32, dtype=torch.int32)


class Grammars:
    """The engine's grammar side: one llguidance tokenizer for the model (built on the first request that
    has a grammar: about a second; an engine loop builds it on a side thread first, `prepare`, so running
    streams do not wait for it), a matcher per such sequence."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf_tokenizer = hf_tokenizer  # a callable: the engine's tokenizer, loaded on first use
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._building = threading.Lock()  # the engine thread and a side thread may both ask for it

    @property
    def is_ready(self) -> bool:
        return self._tokenizer is not None

    def prepare(self) -> None:
        """Build the llguidance tokenizer (and the model's tokenizer under it) now, on the calling thread.
        Safe while steps run: a step touches only its sequences' matchers."""
        _ = self.tokenizer

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            with self._building:
                if self._tokenizer is None:
                    import llguidance.hf  # NOTE: here, not at the top: it imports transformers
                    eos = list(self.eos_token_ids) or None
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer(), n_vocab=self.vocab_size,
                                                                   eos_token=eos)
        return self._tokenizer

    def matcher(self, grammar: str, resumed: list[int]) -> llguidance.LLMatcher:
        """A matcher of `grammar` that has matched `resumed` (the output a resumed leg carries in its prompt)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidRequestError(f"the request's structured-output grammar is invalid: {matcher.get_error()}",
                                      "grammar")
        if resumed and not matcher.consume_tokens(resumed):
            raise InvalidRequestError(f"the {len(resumed)} tokens generated so far do not match the request's "
                                      f"grammar: {matcher.get_error()}", "grammar")
        return matcher

    @staticmethod
    def mask(logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """`logits` ([rows, vocab], one row per matcher, None for a row without a grammar) with each grammar's
        disallowed tokens at -inf: a copy when any row has a grammar (the raw logits stay for logprobs)."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
        for j, i in enumerate(rows):
            row = bitmask[j]
            matchers[i].unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        # NOTE: filled and unpacked here, not with llguidance.torch: importing it sets up torch.compile (7 s of
        # every engine process's start here), and its apply compiled for 1.7 s on the engine thread at first use.
        allowed = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]: bit b of word w is token 32w + b
        allowed = allowed.reshape(len(rows), -1)[:, :vocab].bool().to(logits.device)
        masked = logits.clone()
        masked[rows] = masked[rows].masked_fill(~allowed, float("-inf"))
        return masked

    @staticmethod
    def advance(matcher, token: int) -> bool:
        """Feed a sampled token to a sequence's matcher; True when its grammar is complete (nothing may
        follow). A token the mask did not allow (it cannot happen) fails the request alone."""
        if not matcher.consume_token(token):
            raise InvalidRequestError(f"token {token} broke the request's grammar: {matcher.get_error()}", "grammar")
        return matcher.is_stopped()
