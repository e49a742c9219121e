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
