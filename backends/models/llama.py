"""Our forward pass for the Llama family (Llama, SmolLM, Qwen2) over the paged KV cache.

RMSNorm, RoPE with the config's scaling, grouped-query attention, SwiGLU, tied embeddings and optional
q/k/v biases (Qwen2). All tokens of a step go through the dense layers as one matrix; attention runs once
per group of decode tokens of close context lengths (padded, masked) and once per prefill chunk. Weights
are fused at load (q|k|v and gate|up) so a layer is four matmuls. On a CPU in float32 the matmul weights are
prepacked for oneDNN at load (its linear reads them in its own blocked layout): the decode matmuls, memory
bound, and above all the vocabulary-wide lm_head run up to twice as fast as torch's default GEMM on them."""

import logging

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backends.kernels import fused_ops, paged_attention
from mooncake.engine.runner import ForwardBatch, ModelRunner
from mooncake.errors import ModelError, UnsupportedModelError
from mooncake.kv_geometry import KVSpec

log = logging.getLogger(__name__)


class LlamaRunner(ModelRunner):
    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoConfig

        self.device, self.dtype = device, dtype
        config = AutoConfig.from_pretrained(model_dir)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.kv_spec = KVSpec.from_model_config(config.to_dict())
        self.num_kv_heads, self.head_dim = self.kv_spec.num_kv_heads, self.kv_spec.head_dim
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        self.eos_token_ids = _eos_ids(model_dir, config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{model_dir}: hidden_act {config.hidden_act!r}, only silu is supported")
        self._load_weights(model_dir, config)
        # NOTE: on a CPU in float32, decode attention reads the paged cache in place (a C kernel built at
        # first use); elsewhere, or without a compiler, it gathers K and V for torch's SDPA.
        self.paged = paged_attention.load() if device.type == "cpu" and dtype == torch.float32 else None
        # ... and the residual add + RMSNorm, and RoPE + the KV-cache write, are one C call each
        self.fused = fused_ops.load() if device.type == "cpu" and dtype == torch.float32 else None
        self.cos, self.sin = _rope_tables(config, self.head_dim, self.max_position_embeddings, device, dtype)

    def _load_weights(self, model_dir: Path, config) -> None:
        weights: dict[str, torch.Tensor] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(load_file(str(file)))

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            tensor = weights.pop(name, None)
            if tensor is None and required:
                raise ModelError(f"{model_dir}: weight '{name}' is missing")
            return None if tensor is None else tensor.to(device=self.device, dtype=self.dtype)

        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            biases = [take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv"]
            self.layers.append({
                "ln1": take(p + "input_layernorm.weight"),
                "wqkv": torch.cat([q, k, v]),
                "bqkv": torch.cat(biases) if all(b is not None for b in biases) else None,
                "wo": take(p + "self_attn.o_proj.weight"),
                "bo": take(p + "self_attn.o_proj.bias", required=False),
                "ln2": take(p + "post_attention_layernorm.weight"),
                "wgu": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                "wd": take(p + "mlp.down_proj.weight"),
            })
        self.norm = take("model.norm.weight")
        lm_head = take("lm_head.weight", required=False)
        self.lm_head = self.embed if lm_head is None else lm_head
        self.packed = _packs(self.device, self.dtype, self.lm_head)
        if self.packed:  # NOTE: the tied embedding stays as it is for lookups; the lm_head gets a packed copy
            self.lm_head = _pack(self.lm_head)
            for w in self.layers:
                for key in ("wqkv", "wo", "wgu", "wd"):
                    w[key] = _pack(w[key])
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate = self.layers[0]["wgu"].shape[0] // 2 if self.layers else 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: torch.Tensor, on_layer=None) -> torch.Tensor:
        return self._run(batch, kv, range(self.num_layers), None, on_layer)

    @torch.inference_mode()
    def forward_stage(self, batch: ForwardBatch, kv: torch.Tensor, layers: range,
                      hidden: torch.Tensor | None) -> torch.Tensor:
        if not (0 <= layers.start < layers.stop <= self.num_layers and layers.step == 1):
            raise ModelError(f"stage layers {layers.start}..{layers.stop - 1} are not a range of the model's "
                             f"{self.num_layers} layers")
        if (hidden is None) != (layers.start == 0):
            raise ModelError("a stage takes the previous stage's hidden states, and only the first stage none")
        if kv.shape[0] != len(layers):
            raise ModelError(f"a stage of {len(layers)} layers was given a cache of {kv.shape[0]}")
        return self._run(batch, kv, layers, hidden, None)

    def _run(self, batch: ForwardBatch, kv: torch.Tensor, layers: range, hidden: torch.Tensor | None,
             on_layer) -> torch.Tensor:
        """Layers `layers` over the batch, from the embeddings (hidden None) or the given hidden states, kv[i]
        the cache of layer layers.start + i; logits at logits_indices after the last layer, else the hidden
        states after layers.stop - 1."""
        n = batch.input_ids.shape[0]
        if hidden is None:
            hidden = F.embedding(batch.input_ids, self.embed)
        elif self.fused is not None:
            # NOTE: the fused residual add writes in place: a copy of the caller's, in the layout it reads
            hidden = hidden.to(self.dtype, memory_format=torch.contiguous_format, copy=True)
        cos = sin = None
        if self.fused is None:
            cos, sin = self.cos.index_select(0, batch.positions), self.sin.index_select(0, batch.positions)
        delta = None  # the residual still to be added to hidden: the last layer's MLP output
        for layer_id in layers:
            w = self.layers[layer_id]
            hidden, x = self._add_norm(hidden, delta, w["ln1"])
            qkv = self._linear(x, w["wqkv"], w["bqkv"])
            kv_layer = kv[layer_id - layers.start]
            q = self._rope_store(qkv, batch, cos, sin, kv_layer)
            if on_layer is not None:
                on_layer(layer_id)
            attn = self._attention(batch, q, kv_layer)
            hidden, x = self._add_norm(hidden, self._linear(attn.view(n, self.q_size), w["wo"], w["bo"]), w["ln2"])
            gate, up = self._linear(x, w["wgu"]).split(self.intermediate, dim=-1)
            delta = self._linear(F.silu(gate) * up, w["wd"])
        if delta is not None:
            hidden = hidden + delta
        if layers.stop < self.num_layers:
            return hidden
        last = _rms_norm(hidden[batch.logits_indices], self.norm, self.eps)
        return self._linear(last, self.lm_head).float()

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, RMSNorm of it): the residual add and the next norm."""
        if self.fused is not None:
            return hidden, self.fused.add_rms_norm(hidden, delta, weight, self.eps)
        if delta is not None:
            hidden = hidden + delta
        return hidden, _rms_norm(hidden, weight, self.eps)

    def _rope_store(self, qkv: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor | None,
                    sin: torch.Tensor | None, kv_layer: torch.Tensor) -> torch.Tensor:
        """q [n, heads, d] rotated; k rotated and v written into this layer's cache at the batch's slots."""
        if self.fused is not None and kv_layer.is_contiguous():
            return self.fused.rope_store(qkv, self.cos, self.sin, batch.positions, batch.slot_mapping, kv_layer,
                                         self.num_heads)
        if cos is None:
            cos, sin = self.cos.index_select(0, batch.positions), self.sin.index_select(0, batch.positions)
        n, heads = qkv.shape[0], self.num_heads + self.num_kv_heads
        # NOTE: q and k rotated in one call (their heads side by side in qkv): half the ops of two
        qk = fused_ops.rope(qkv[:, :self.q_size + self.kv_size].view(n, heads, self.head_dim), cos, sin)
        v = qkv[:, self.q_size + self.kv_size:]
        kv_layer[0].index_copy_(0, batch.slot_mapping, qk[:, self.num_heads:])
        kv_layer[1].index_copy_(0, batch.slot_mapping, v.view(n, self.num_kv_heads, self.head_dim))
        return qk[:, :self.num_heads]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def _attention(self, batch: ForwardBatch, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """q: [n, heads, d]; kv_layer: this layer's [2, slots, kv_heads, d] cache, new tokens included."""
        nd = batch.num_decode
        decode_out = None
        if nd:
            # Per group of close context lengths, one gather for K and V: [2, rows, ctx, kvh, d] ->
            # [2, rows, kvh, ctx, d]. The query's heads are grouped per KV head ([rows, kvh, group, d]) so
            # GQA needs no repeat of K and V.
            qd = q[:nd].view(nd, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
            parts = []
            for group in batch.decode_groups:
                if (self.paged is not None and group.context_lens is not None and group.block_table is not None
                        and kv_layer.is_contiguous()):
                    parts.append(self.paged.attend(q[group.start:group.stop], kv_layer, group.block_table,
                                                   group.context_lens, group.block_size))
                    continue
                k, v = _gather_context(kv_layer, group).transpose(2, 3)
                parts.append(F.scaled_dot_product_attention(qd[group.start:group.stop], k, v, attn_mask=group.mask))
            decode_out = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(nd, self.num_heads, self.head_dim)
            if not batch.prefills:
                return decode_out
        out = torch.empty_like(q)
        if decode_out is not None:
            out[:nd] = decode_out
        for span in batch.prefills:
            qp = q[span.start:span.start + span.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
            k, v = _gather(kv_layer, span.context_slots).transpose(1, 2).unsqueeze(1)  # [1, kvh, ctx, d] each
            ctx = k.shape[2]
            if ctx == span.num_tokens:
                o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, enable_gqa=True)
            else:  # a later chunk: every query also sees the ctx - n tokens before the chunk
                rows = torch.arange(span.num_tokens, device=q.device)[:, None] + (ctx - span.num_tokens)
                mask = torch.arange(ctx, device=q.device)[None, :] <= rows
                o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, enable_gqa=True)
            out[span.start:span.start + span.num_tokens] = o[0].transpose(0, 1)
        return out


def _gather_context(kv_layer: torch.Tensor, group) -> torch.Tensor:
    """A decode group's contexts, [2, rows, max_context, kv_heads, d]: whole blocks by its block table (about
    1.5x faster per layer at batch 32 and 300 tokens of context than by slots), or by slots."""
    rows, max_len = group.context_slots.shape
    if group.block_table is None:
        return _gather(kv_layer, group.context_slots.view(-1)).view(2, rows, max_len, *kv_layer.shape[2:])
    bs, table = group.block_size, group.block_table
    blocks = kv_layer.view(2, kv_layer.shape[1] // bs, bs, *kv_layer.shape[2:]).index_select(1, table.view(-1))
    return blocks.view(2, rows, table.shape[1] * bs, *kv_layer.shape[2:])[:, :, :max_len]


def _gather(kv_layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    # NOTE: index_select is about 5x faster than advanced indexing (kv_layer[:, slots]) for row gathers.
    return kv_layer.index_select(1, slots)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # torch's own op: the same arithmetic, bit for bit, in fewer operations
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Same op order as the reference implementation (normalise in float32, then scale).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope_tables(config, head_dim: int, max_positions: int, device, dtype):
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
            raise UnsupportedModelError(f"RoPE scaling type {rope_type!r} is not supported")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device, dtype), (emb.sin() * scaling).to(device, dtype)


def _eos_ids(model_dir: Path, config) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    gen_file = Path(model_dir) / "generation_config.json"
    if gen_file.exists():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return tuple(sorted(ids))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in]) in oneDNN's layout for its linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def _packs(device: torch.device, dtype: torch.dtype, sample: torch.Tensor) -> bool:
    """Whether to use oneDNN's prepacked linear: on a CPU, in float32, when this torch has it and it gives
    F.linear's answer on one of the model's weights (else the model runs on F.linear, and says why)."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        x = torch.randn(3, sample.shape[1], generator=torch.Generator().manual_seed(0))
        got = torch.ops.mkldnn._linear_pointwise(x, _pack(sample), None, "none", [], "")
        want = F.linear(x, sample)
    except (RuntimeError, AttributeError) as exc:
        log.info("oneDNN's prepacked linear is not available here (%s); using torch's", exc)
        return False
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        log.warning("oneDNN's prepacked linear disagrees with torch's here (max difference %g); using torch's",
                    (got - want).abs().max().item())
        return False
    return True
