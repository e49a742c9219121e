"""The API process's tokenizer: the model's `tokenizer.json` through the `tokenizers` library and its chat
template through jinja2, as transformers does both, without `transformers.AutoTokenizer`, which imports
torch: an API process stays small (no model runs there). Prefill and decode keep transformers'
tokenizer. tests/test_tokenizer.py holds the two to the same ids, text and prompts."""

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mooncake.errors import InvalidRequestError, ModelError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class LightTokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        try:
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001  the library raises its own exception type
            raise ModelError(f"cannot load {path / 'tokenizer.json'}: {exc}") from None
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special_tokens = {k: _content(config.get(k)) for k in SPECIAL_TOKEN_KEYS if config.get(k)}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        self.chat_template: str | None = template
        self._compiled = None
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, which may be part of a UTF-8 character: a byte-level BPE
        token's bytes, a `<0xNN>` byte token's byte, else its text. None for an id the tokenizer lacks
        (a model's vocabulary may be larger than its tokenizer's)."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if match := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(match[1], 16)])
        return self.decode([token_id]).encode()

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False, tools: list[dict] | None = None) -> str:
        """The prompt text of `messages` (tokenize=False only: callers tokenize it themselves)."""
        if tokenize:
            raise ValueError("LightTokenizer.apply_chat_template renders text; tokenize it with __call__")
        if self.chat_template is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt")
        if self._compiled is None:
            self._compiled = _environment().from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     documents=None, **self.special_tokens)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: every byte as a printable character (the byte itself where it is
    printable, else one from 256 up)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _content(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    return token["content"] if isinstance(token, dict) else str(token)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (its helpers included)."""
    def raise_exception(message):
        raise InvalidRequestError(f"the chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
