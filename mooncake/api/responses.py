"""OpenAI's response objects for completions and chat completions, whole and as stream chunks, for one
or several choices (`n`), and their usage."""


def usage(flights: list) -> dict:
    """One prompt, counted once; the completion tokens of every choice."""
    num_prompt = len(flights[0].prompt_token_ids)
    completion = sum(f.num_completion_tokens for f in flights)
    return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max(f.num_cached_tokens for f in flights)}}


class Shape:
    def __init__(self, chat: bool, response_id: str, created: int, model: str, with_token_ids: bool):
        self.chat, self.id, self.created, self.model, self.with_token_ids = chat, response_id, created, model, \
            with_token_ids

    def _envelope(self, object_name: str, choices: list, usage=None) -> dict:
        out = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice(self, index, text, token_ids, finish_reason, key: str, first: bool = False) -> dict:
        if self.chat:
            content = {"role": "assistant", "content": text} if first or key == "message" else (
                {"content": text} if text or finish_reason is None else {})
            choice = {"index": index, key: content, "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if self.with_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def whole(self, outs: list[tuple[str, list[int], str | None]], usage) -> dict:
        """`outs`: (text, token ids, finish reason) of each choice, in index order."""
        key = "message" if self.chat else "text"
        choices = [self._choice(i, *out, key) for i, out in enumerate(outs)]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage)

    def chunk(self, index, text, token_ids, finish_reason, first: bool = False) -> dict:
        if self.chat:
            return self._envelope("chat.completion.chunk",
                                  [self._choice(index, text, token_ids, finish_reason, "delta", first)])
        return self._envelope("text_completion", [self._choice(index, text, token_ids, finish_reason, "text")])

    def usage_chunk(self, usage) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
