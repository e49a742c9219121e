"""Builds the models written from a TOML spec: the random-weight test model (fixed seed) and emulated
models (no weights); both with a byte-level tokenizer and a ChatML template."""

import json
import tomllib
from pathlib import Path

from mooncake.errors import ModelError

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258


def build_random_model(spec_path: Path, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        spec = tomllib.loads(Path(spec_path).read_text())
        seed, config_fields = spec["seed"], spec["config"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        raise ModelError(f"bad random-model spec {spec_path}: {exc}") from None
    config = LlamaConfig(**config_fields)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    _byte_tokenizer().save_pretrained(out)
    meta = {"seed": seed, "spec": Path(spec_path).name}
    (out / "mooncake-random-model.json").write_text(json.dumps(meta))


def build_emulated_model(spec_path: Path, out: Path) -> None:
    """config.json from the spec's [config], with its [cost] as "emulation" and its [answers] (optional:
    the output-length distribution) as "answers" (both checked here, read by the runner), and the
    byte-level tokenizer."""
    from mooncake.answer_lengths import AnswerLengths
    from mooncake.cost import CostModel

    try:
        spec = tomllib.loads(Path(spec_path).read_text())
        config, cost, answers = dict(spec["config"]), spec["cost"], spec.get("answers")
        if answers is not None:
            AnswerLengths(answers["quantiles"])
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"bad emulated-model spec {spec_path}: {exc}") from None
    CostModel.from_dict(cost, f"{spec_path} [cost]")
    out.mkdir(parents=True, exist_ok=True)
    extra = {"answers": answers} if answers is not None else {}
    (out / "config.json").write_text(json.dumps({**config, "emulation": cost, **extra}, indent=2))
    _byte_tokenizer().save_pretrained(out)
    (out / "mooncake-emulated-model.json").write_text(json.dumps({"spec": Path(spec_path).name}))


def _byte_tokenizer():
    """One token per byte (no merges) plus ChatML specials: tiny, and any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = len(alphabet) + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)
