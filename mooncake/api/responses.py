"""OpenAI's response objects for completions and chat completions, whole and as stream chunks, for one
or several choices (`n`, and a batch of prompts), and their usage."""

import codecs


def usage(flights: list, n: int = 1, generates: bool = True) -> dict:
    """Each prompt counted once (its `n` choices are consecutive flights); the completion tokens of every
    choice (none without `generates`: echo with max_tokens 0)."""
    prompts = [flights[i:i + n] for i in range(0, len(flights), n)]
    num_prompt = sum(len(choices[0].prompt_token_ids) for choices in prompts)
    completion = sum(f.num_completion_tokens for f in flights) if generates else 0
    cached = sum(max(f.num_cached_tokens for f in choices) for choices in prompts)
    return {"prompt_tokens": num_prompt, "completion_tokens": completion, "total_tokens": num_prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Shape:
    def __init__(self, chat: bool, response_id: str, created: int, model: str, with_token_ids: bool,
                 tokenizer=None):
        self.chat, self.id, self.created, self.model, self.with_token_ids = chat, response_id, created, model, \
            with_token_ids
        self.tokenizer = tokenizer  # renders tokens of logprobs as text
        self._text_so_far: dict[int, tuple] = {}  # per choice: (its text's length, a UTF-8 decoder of its bytes)

    def _envelope(self, object_name: str, choices: list, usage=None) -> dict:
        out = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice(self, index, text, token_ids, finish_reason, key: str, first: bool = False,
                logprobs=None, prompt_logprobs=None, tool_calls=None) -> dict:
        shown = None if logprobs is None else self._logprobs(index, token_ids, logprobs)
        if self.chat:
            content = {"role": "assistant", "content": text} if first or key == "message" else (
                {"content": text} if text or finish_reason is None and not tool_calls else {})
            if tool_calls and key == "message":  # NOTE: OpenAI's: no text beside the calls is null content
                content = {"role": "assistant", "content": text.strip() or None, "tool_calls": tool_calls}
            elif tool_calls:
                content["tool_calls"] = tool_calls
            choice = {"index": index, key: content, "finish_reason": finish_reason, "logprobs": shown}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": shown}
            if prompt_logprobs is not None:  # vLLM's (mooncake/api/echo.py)
                choice["prompt_logprobs"] = prompt_logprobs
        if self.with_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _logprobs(self, index: int, token_ids: list[int], logprobs: list) -> dict:
        """OpenAI's logprobs object for these tokens (`TokenLogprob`s): chat's `{"content": [...]}`, or
        the legacy completions shape with tokens, token_logprobs, top_logprobs and text_offset. A token
        that is part of a UTF-8 character is shown as `bytes:\\xNN...` (its `bytes` are exact), one the
        tokenizer lacks as `token_id:N` (as vLLM's return_tokens_as_token_ids)."""
        chosen = [(t, self.tokenizer.token_bytes(t)) for t in token_ids]
        if self.chat:
            return {"content": [{**_token(*tok, lp.logprob),
                                 "top_logprobs": [_token(t, self.tokenizer.token_bytes(t), v) for t, v in lp.top]}
                                for tok, lp in zip(chosen, logprobs)]}
        # NOTE: offsets into the choice's text as its tokens' bytes decode, a split character once whole.
        text_len, decoder = self._text_so_far.get(index) or (0, codecs.getincrementaldecoder("utf-8")("replace"))
        offsets = []
        for _, raw in chosen:
            offsets.append(text_len)
            text_len += len(decoder.decode(raw or b""))
        self._text_so_far[index] = (text_len, decoder)
        texts = [_text(*tok) for tok in chosen]
        # NOTE: an echoed prompt's first token has none (None), as in OpenAI's and vLLM's answers.
        return {"tokens": texts, "token_logprobs": [lp and lp.logprob for lp in logprobs],
                # NOTE: as vLLM: the chosen token is among its top_logprobs even when not one of the likeliest.
                "top_logprobs": [lp and {**{_text(t, self.tokenizer.token_bytes(t)): v for t, v in lp.top},
                                         text: lp.logprob} for text, lp in zip(texts, logprobs)],
                "text_offset": offsets}

    def whole(self, outs: list[tuple], usage) -> dict:
        """`outs`: (text, token ids, finish reason, logprobs or None, prompt logprobs or None, tool calls or
        None) of each choice, in index order."""
        key = "message" if self.chat else "text"
        choices = [self._choice(i, text, ids, reason, key, logprobs=logprobs, prompt_logprobs=prompt, tool_calls=calls)
                   for i, (text, ids, reason, logprobs, prompt, calls) in enumerate(outs)]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage)

    def chunk(self, index, text, token_ids, finish_reason, first: bool = False, logprobs=None,
              prompt_logprobs=None, tool_calls=None) -> dict:
        if self.chat:
            return self._envelope("chat.completion.chunk", [self._choice(index, text, token_ids, finish_reason,
                                                                         "delta", first, logprobs, None, tool_calls)])
        return self._envelope("text_completion", [self._choice(index, text, token_ids, finish_reason, "text",
                                                               logprobs=logprobs, prompt_logprobs=prompt_logprobs)])

    def usage_chunk(self, usage) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)


def _text(token_id: int, raw: bytes | None) -> str:
    if raw is None:
        return f"token_id:{token_id}"
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _token(token_id: int, raw: bytes | None, logprob: float) -> dict:
    return {"token": _text(token_id, raw), "logprob": logprob, "bytes": None if raw is None else list(raw)}
