"""Shared fixtures: the tiny random model (always) and the real SmolLM2 (fetched once into the cache),
each with a Hugging Face `transformers` reference for parity checks."""

import os

import pytest
import torch

from mooncake.env import offline_hub

offline_hub()
# NOTE: two threads match this machine's two cores; more only adds contention between tests.
torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY = "tiny-llama"
REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tiny_dir():
    from mooncake.models.fetch import fetch_model
    return fetch_model(TINY)


@pytest.fixture(scope="session")
def real_dir():
    from mooncake.models.fetch import fetch_model
    return fetch_model(REAL)


class HFReference:
    """Greedy generation with transformers on the same weights: the parity baseline."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        out = self.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                  dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    @torch.inference_mode()
    def logprobs(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """[len(output_ids), vocab]: the log-distribution each output token was drawn from."""
        ids = torch.tensor([prompt_ids + output_ids])
        logits = self.model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]


_references: dict = {}


def hf_reference(path) -> HFReference:
    if path not in _references:
        _references[path] = HFReference(path)
    return _references[path]
