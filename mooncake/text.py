"""Prompt text <-> token ids around the tokenizer: chat templates and stop-string truncation."""

from mooncake.errors import InvalidRequestError


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of `prompt`; with `chat`, as a single user turn through the model's chat template."""
    if not chat:
        return tokenizer(prompt)["input_ids"]
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids of `messages` through the model's chat template (given `tools` when it renders
    them: mooncake/api/tools.py)."""
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt")
    # Render to text, then tokenize without adding specials: the template already holds them, and this
    # form behaves the same across transformers versions.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_completion(tokenizer, token_ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """Completion text without special tokens, cut before the first stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


class IncrementalDetokenizer:
    """Text deltas of a growing completion, for streaming, with stop strings matched across tokens.
    Holds back a trailing partial UTF-8 character and the tail that could still begin a stop string.

    Each call decodes only a window of the latest tokens, from where the previous call's new tokens
    began: the new text is what the window decodes to beyond what its older tokens decode to, so a
    tokenizer's treatment of a decode's first token (a dropped leading space) cancels out. A window
    starts at a boundary that ended a whole character. Decoding the whole completion on every call, as
    this did, cost 184 us a token at 2,048 tokens (6.4 us now), quadratic in its length, and the
    conductor does it for every token of every stream."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.text = ""  # the completion's text decoded so far (whole characters)
        self.emitted = 0  # characters of the text already returned
        self.stopped = False
        self._prefix = 0  # the window's first token
        self._read = 0  # tokens [_prefix, _read) decode to the end of `text`

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The new text to send after `token_ids`; sets `stopped` when a stop string matched (the text
        ends before it). With `final`, flush what was held back."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        known = self._decode(self._prefix, self._read)
        window = self._decode(self._prefix, len(self.token_ids))
        searched = len(self.text)
        if final or not window.endswith("\ufffd"):  # an incomplete character decodes as U+FFFD
            self.text += window[len(known):]
            self._prefix, self._read = self._read, len(self.token_ids)
        text = self.text
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, searched - longest + 1)  # a stop string ending before that was found already
        cuts = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        if cuts:
            self.stopped = True
            end = min(cuts)
        elif final or not self.stop:
            end = len(text)
        else:  # hold back what could still grow into a stop string
            end = max(self.emitted, len(text) - longest + 1)
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _decode(self, start: int, stop: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:stop], skip_special_tokens=True) if stop > start else ""
