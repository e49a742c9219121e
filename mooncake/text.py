"""Prompt text <-> token ids around the tokenizer: chat templates and stop-string truncation."""

from mooncake.errors import InvalidRequestError


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of `prompt`; with `chat`, as a single user turn through the model's chat template."""
    if not chat:
        return tokenizer(prompt)["input_ids"]
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt")
    # Render to text, then tokenize without adding specials: the template already holds them, and this
    # form behaves the same across transformers versions.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_completion(tokenizer, token_ids: list[int], stop: tuple[str, ...] = ()) -> str:
    """Completion text without special tokens, cut before the first stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


class IncrementalDetokenizer:
    """Text deltas of a growing completion, for streaming, with stop strings matched across tokens.
    Holds back a trailing partial UTF-8 character and the tail that could still begin a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the text already returned
        self.stopped = False

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The new text to send after `token_ids`; sets `stopped` when a stop string matched (the text
        ends before it). With `final`, flush what was held back."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            self.stopped = True
            end = min(cuts)
        elif final:
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd"))  # an incomplete character decodes as U+FFFD
            if self.stop:  # hold back what could still grow into a stop string
                end = max(self.emitted, end - max(len(s) for s in self.stop) + 1)
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta
