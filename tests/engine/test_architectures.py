"""The other Llama-family shapes our runner claims: Qwen2 (q/k/v biases, untied head), Llama with
llama3 RoPE scaling, and bfloat16. Random small models built here, checked against transformers."""

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from mooncake.models.tiny import _byte_tokenizer
from tests.conftest import HFReference

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.2, bos_token_id=257, eos_token_id=258, pad_token_id=256)


def build(tmp_path, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(7)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False))
        for layer in model.model.layers:  # random init leaves biases at zero; make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    else:
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
        model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling=rope, tie_word_embeddings=True))
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    _byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["qwen2", "llama3-rope"])
def test_greedy_matches_transformers(tmp_path, kind):
    path = build(tmp_path, kind)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=16, prefill_chunk=32, num_kv_blocks=64))
    ids = engine.tokenizer("a prompt that is long enough to span several blocks of sixteen")["input_ids"]
    (out,) = engine.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))
    assert out.token_ids == HFReference(path).greedy(ids, 40)


def test_bfloat16_runs_and_moves_bfloat16_kv(tiny_dir):
    cfg = EngineConfig(model=str(tiny_dir), dtype="bfloat16", block_size=8, num_kv_blocks=64)
    engine = LLMEngine(cfg)
    ids = engine.tokenizer("bfloat16 prompt here")["input_ids"]
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    payloads = engine.export_kv(rid)
    first = engine.pop_completion(rid).token_ids
    assert payloads and all(p.dtype == "bfloat16" for p in payloads)
    (alone,) = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))
    other = LLMEngine(cfg)
    rid = other.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True), kv_payloads=payloads)
    while other.has_unfinished():
        other.step()
    resumed = other.pop_completion(rid)
    assert resumed.num_cached_tokens == len(payloads) * 8
    assert resumed.token_ids[0] == first[0] and resumed.token_ids == alone.token_ids
