"""Completions' `echo` and vLLM's `prompt_logprobs`, on each choice's first event: with echo its text, token
ids and logprobs start with its prompt's (the first prompt token's logprob is null, as OpenAI and vLLM
answer); with `prompt_logprobs` the choice lists each prompt token's, vLLM's way. With `max_tokens: 0` (echo
only) the one token computed to end the prompt is dropped: the answer is the prompt alone. Prefill computes
the prompt's logprobs (`SamplingParams.prompt_logprobs`) and sends them with the first token."""

from mooncake.api.flight import StreamEvent
from mooncake.errors import RequestError
from mooncake.sampling import TokenLogprob


class Echo:
    def __init__(self, parsed, flights: list, tokenizer):
        self.parsed, self.flights, self.tokenizer = parsed, flights, tokenizer
        self.started: set[int] = set()  # choices whose first event went by

    def __call__(self, index: int, event: StreamEvent) -> tuple[StreamEvent, list | None]:
        """Choice `index`'s event as the client sees it, and (on its first event, when asked) its prompt's
        logprobs in vLLM's shape."""
        p = self.parsed
        if not p.generates:
            event = StreamEvent("", [], event.finish_reason and "length", None if event.logprobs is None else [],
                                event.prompt_logprobs)
        if index in self.started or not (p.echo or p.shows_prompt_logprobs):
            return event, None
        self.started.add(index)
        flight = self.flights[index]
        prompt = flight.prompt_token_ids
        computed = event.prompt_logprobs
        if p.params.prompt_logprobs is not None and (computed is None or len(computed) != len(prompt) - 1):
            raise RequestError(f"request {flight.request_id}: its prompt's logprobs did not come with its first "
                               f"token")
        shown = vllm_prompt_logprobs(self.tokenizer, prompt, computed) if p.shows_prompt_logprobs else None
        if not p.echo:
            return event, shown
        logprobs = event.logprobs
        if logprobs is not None:
            k = p.params.logprobs
            logprobs = [None, *(TokenLogprob(lp.logprob, lp.top[:k], lp.rank) for lp in computed), *logprobs]
        text = self.tokenizer.decode(prompt)
        return StreamEvent(text + event.text, prompt + event.token_ids, event.finish_reason, logprobs), shown


def vllm_prompt_logprobs(tokenizer, prompt: list[int], computed: list[TokenLogprob]) -> list:
    """vLLM's `prompt_logprobs`: null for the first token, then per token {token id: {logprob, rank,
    decoded_token}} of the token itself and the likeliest ones."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}
    shown = [None]
    for token_id, lp in zip(prompt[1:], computed):
        tops = {str(t): entry(t, v, r) for r, (t, v) in enumerate(lp.top, start=1) if t != token_id}
        shown.append({str(token_id): entry(token_id, lp.logprob, lp.rank), **tops})
    return shown
