"""An emulated model: everything real but the arithmetic (as Dynamo's mocker and llm-d's inference
simulator test routers at scale without GPUs).

The engine, its scheduler, paged KV cache, prefix cache, batching, preemption, KV export and import run
as they do for a real model. Only `forward` is replaced: it writes small, deterministic KV for the new
tokens, picks each next token from the last token, its position and a digest of the sequence's KV as it
lies in the cache (so a block lost or garbled on its way from prefill to decode changes the stream), ends
each answer with EOS at a length that is a function of the prompt (mooncake/answer_lengths.py: the
simulator computes the same; a model without an output-length distribution never ends on its own), and
carries the cost model (`mooncake/cost.py`, the one the simulator charges) as its `modelled` time
(mooncake/engine/modelled_time.py): the engine's step lasts what that gives the step on the emulated
hardware, divided by `engine.emulation_speedup`.

The model directory comes from a spec in configs/models/ (`mooncake model fetch emulated-llama3-70b`):
its config.json holds the engine-facing shape (vocabulary, context, real KV dims), the cost model as
"emulation" and the output-length distribution as "answers"."""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mooncake.answer_lengths import ANSWER_ALPHABET, KV_MODULUS, AnswerLengths, kv_cells, mix
from mooncake.cost import CostModel
from mooncake.engine.modelled_time import ModelledTime
from mooncake.engine.runner import ForwardBatch, ModelRunner
from mooncake.errors import ModelError
from mooncake.kv_geometry import KVSpec



class EmulatedRunner(ModelRunner):
    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, speedup: float = 1.0,
                 step_model: str = ""):
        path = Path(model_dir) / "config.json"
        config = json.loads(path.read_text())
        if "emulation" not in config:
            raise ModelError(f"{path}: no 'emulation' table: not an emulated model directory")
        cost = dict(config["emulation"], **({"step_model": step_model} if step_model else {}))
        self.modelled = ModelledTime(CostModel.from_dict(cost, f"{path} emulation"), speedup,
                                     config.get("kv_capacity_tokens"))
        self.device, self.dtype = device, dtype
        self.kv_spec = KVSpec.from_model_config(config)
        self.vocab_size = config["vocab_size"]
        self.max_position_embeddings = config["max_position_embeddings"]
        self.eos_token_ids = (config["eos_token_id"],)
        try:
            self.answers = AnswerLengths(config["answers"]["quantiles"]) if "answers" in config else None
        except (TypeError, KeyError, ValueError) as exc:
            raise ModelError(f"{path} answers: {exc}") from None
        tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.alphabet = [tokenizer.encode(c, add_special_tokens=False).ids[0] for c in ANSWER_ALPHABET]
        self._alphabet = torch.tensor(self.alphabet, dtype=torch.long, device=device)

    @classmethod
    def from_engine_config(cls, model_dir, device, dtype, config) -> "EmulatedRunner":
        return cls(model_dir, device, dtype, config.emulation_speedup, config.emulation_step_model)

    def forward(self, batch: ForwardBatch, kv: torch.Tensor, on_layer=None) -> torch.Tensor:
        """The batch's KV and logits at once; the engine then waits out what `modelled` says the step takes
        (from the step's start, so scheduling, sampling and this count toward it), handing each layer on
        at its modelled end."""
        self._write_kv(batch, kv)
        return self._logits(batch, kv)

    def forward_stage(self, batch: ForwardBatch, kv: torch.Tensor, layers: range,
                      hidden: torch.Tensor | None) -> torch.Tensor:
        """A CPP stage: its layers' KV (the stage waits out its share of the step's modelled time). The "hidden
        state" handed on is each token's (digest, answer run, prompt key) (int64 [num_tokens, 3]), taken by
        the first stage from layer 0 as `forward` takes them, so the last stage picks the tokens `forward`
        would."""
        num_layers = self.kv_spec.num_layers
        if not (0 <= layers.start < layers.stop <= num_layers and layers.step == 1):
            raise ModelError(f"stage layers {layers.start}..{layers.stop - 1} are not a range of the model's "
                             f"{num_layers} layers")
        if (hidden is None) != (layers.start == 0):
            raise ModelError("a stage takes the previous stage's hidden states, and only the first stage none")
        if kv.shape[0] != len(layers):
            raise ModelError(f"a stage of {len(layers)} layers was given a cache of {kv.shape[0]}")
        self._write_kv(batch, kv, layers)
        if hidden is None:
            hidden = torch.zeros(len(batch.input_ids), 3, dtype=torch.int64, device=self.device)
            hidden[batch.logits_indices] = torch.tensor(self._digests(batch, kv), dtype=torch.int64,
                                                        device=self.device).reshape(-1, 3)
        if layers.stop < num_layers:
            return hidden
        return self._logits(batch, kv, [tuple(row) for row in hidden[batch.logits_indices].tolist()])

    def _write_kv(self, batch: ForwardBatch, kv: torch.Tensor, layers: range | None = None) -> None:
        """Each new token's KV: small integers from its id and position, different per layer and K|V, but
        layer 0's V, which is 1 for an answer token and 0 for any other (so the answer run can be read back
        from the cache). kv[i] is layer layers.start + i (a stage's cache), default all layers."""
        base = kv_cells(batch.input_ids, batch.positions)
        shape = (len(base), self.kv_spec.num_kv_heads, self.kv_spec.head_dim)
        layers = layers or range(self.kv_spec.num_layers)
        for layer in layers:
            for which in (0, 1):
                if (layer, which) == (0, 1):
                    values = torch.isin(batch.input_ids, self._alphabet).to(kv.dtype)
                else:
                    values = ((base + 2 * layer + which) % KV_MODULUS).to(kv.dtype)
                kv[layer - layers.start, which].index_copy_(0, batch.slot_mapping, values[:, None, None].expand(shape))

    def _digests(self, batch: ForwardBatch, kv: torch.Tensor) -> list[tuple[int, int, int]]:
        """Per token of the flat batch that is sampled, read from the cache (integers, so exact): the sum of
        layer 0's K over its whole context (the digest), the length of the context's trailing run of answer
        tokens, and the sum of layer 0's K before that run (the prompt's key, mooncake/answer_lengths.py)."""
        cells, marks = kv[0, 0, :, 0, 0], kv[0, 1, :, 0, 0]
        digests = {}
        for group in batch.decode_groups:
            lengths = batch.positions[group.start:group.stop] + 1
            rows = _answer_runs(cells[group.context_slots], marks[group.context_slots], lengths)
            digests.update(enumerate(rows, start=group.start))
        wanted = batch.logits_indices.tolist()
        for span in batch.prefills:  # NOTE: its last token's row, and any earlier ones' (prompt logprobs)
            rows = [i for i in wanted if span.start <= i < span.start + span.num_tokens]
            slots = span.context_slots[None, :].expand(len(rows), -1)
            past = len(span.context_slots) - span.num_tokens - span.start + 1
            lengths = torch.tensor([past + i for i in rows], device=slots.device)
            digests.update(zip(rows, _answer_runs(cells[slots], marks[slots], lengths)))
        return [digests[i] for i in wanted]

    def _logits(self, batch: ForwardBatch, kv: torch.Tensor,
                digests: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        rows = batch.logits_indices.tolist()
        # NOTE: finite logits (log-probabilities go out as JSON); the alphabet alone is likely, its pick most.
        logits = torch.full((len(rows), self.vocab_size), -30.0, dtype=torch.float32, device=self.device)
        logits[:, self.alphabet] = 0.0
        tokens, positions = batch.input_ids.tolist(), batch.positions.tolist()
        ends = self.answers is not None and bool(self.eos_token_ids)  # a model without EOS never ends
        for row, (index, (digest, run, key)) in enumerate(zip(rows, self._digests(batch, kv) if digests is None
                                                               else digests)):
            if ends and run + 1 >= self.answers.total(key):
                logits[row, self.eos_token_ids[0]] = 30.0  # the answer's last token: EOS, sampled or not
                continue
            pick = mix(tokens[index], positions[index], digest) % len(self.alphabet)
            logits[row, self.alphabet[pick]] = 4.0  # greedy takes it; sampling mostly (p ~ 0.7)
        return logits


def _answer_runs(cells: torch.Tensor, marks: torch.Tensor, lengths: torch.Tensor) -> list[tuple[int, int, int]]:
    """(digest, answer run, prompt key) per row of contexts [rows, max_len] (layer 0's K and V per slot)
    whose real lengths are `lengths`; what lies beyond a row's length is padding."""
    index = torch.arange(cells.shape[1], device=cells.device)[None, :]
    past = index >= lengths[:, None]
    digest = cells.masked_fill(past, 0).sum(dim=1, dtype=torch.int64)
    last_other = torch.where((marks == 0) & ~past, index, -1).max(dim=1).values  # -1: all answer tokens
    run = lengths - 1 - last_other
    key = cells.masked_fill(index > last_other[:, None], 0).sum(dim=1, dtype=torch.int64)
    return list(zip(digest.tolist(), run.tolist(), key.tolist()))
