"""Layer-wise KV streaming in the engine: each step hands every layer of the blocks it fills to the
layer sink as soon as that layer is written, and a decode engine that imports those layer slices
generates what the prefill engine would."""

import asyncio

import torch

from mooncake.engine import LLMEngine, SamplingParams
from mooncake.instance.engine_loop import EngineLoop

PROMPT = list(range(3, 45))  # 42 tokens: 5 full blocks of 8, filled over three steps of 16
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_every_filled_block_reaches_the_sink_layer_by_layer_as_each_layer_is_written(cfg):
    engine = LLMEngine(cfg)
    num_layers = engine.runner.kv_spec.num_layers
    calls, seen = [], {}

    def layer_bytes(block, layer) -> bytes:
        return bytes(engine.export_blocks([(block, 0)], layer)[0].data)

    def sink(layer, filled, ready_at):
        assert (ready_at is not None) == (layer is not None and engine.runner.modelled is not None)
        calls.append(None if layer is None else (layer, [(f.first_block, len(f.blocks)) for f in filled]))
        if layer is None:
            engine.block_pool.release([block for f in filled for block, _ in f.blocks])
            return
        assert all(engine.block_pool.ref_counts[block] >= 2 for f in filled for block, _ in f.blocks)  # pinned
        for f in filled:
            for i, (block, _) in enumerate(f.blocks):
                seen[(f.first_block + i, layer)] = layer_bytes(block, layer)
                if layer + 1 < num_layers and not engine.runner.modelled:  # the next layer: not yet
                    seen[(f.first_block + i, layer + 1, "early")] = layer_bytes(block, layer + 1)

    engine.layer_sink = sink
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), keep_kv=True)
    while engine.has_unfinished():
        engine.step()
    per_step = [c[1] for c in calls if c is not None and c[0] == 0]
    assert per_step == [[(0, 2)], [(2, 2)], [(4, 1)]]  # 16 + 16 + 10 tokens: blocks 0-1, 2-3, 4
    assert [c[0] if c else None for c in calls] == ([*range(num_layers), None] * 3)  # in order, then done
    final = engine.export_kv(rid)
    for index, payload in enumerate(final):  # what the sink saw of each layer is that layer's final KV
        whole = torch.frombuffer(bytearray(payload.data), dtype=getattr(torch, payload.dtype)).view(payload.shape)
        for layer in range(num_layers):
            assert seen[(index, layer)] == whole[layer].contiguous().numpy().tobytes()
            early = seen.get((index, layer + 1, "early"))
            if early is not None:
                assert early != whole[layer + 1].contiguous().numpy().tobytes()
    engine.pop_completion(rid)
    assert not any(engine.block_pool.ref_counts)  # every pin released


def test_decode_from_layer_slices_streamed_through_the_engine_loop_equals_generate(cfg):
    """A prefill engine loop streams layers (as the prefill role does); a decode engine imports the
    slices and continues: the same tokens as one engine generating the whole request."""
    expected = LLMEngine(cfg).generate([PROMPT], GREEDY)[0].token_ids
    prefill = LLMEngine(cfg)

    async def run():
        got = []

        async def on_outputs(outputs):
            pass

        async def on_failed(ids, error, is_invalid=False):
            raise AssertionError(error)

        loop = EngineLoop(prefill, on_outputs, on_failed)
        loop.start()
        try:
            loop.stream_layers(lambda layer, filled, future: got.append(future))
            rid = await loop.call(prefill.add_request, PROMPT, SamplingParams(max_tokens=1, ignore_eos=True),
                                  None, (), True)
            while (await loop.call(lambda: prefill.seqs[rid].is_finished)) is False:
                await asyncio.sleep(0.01)
            slices = [p for future in got for per_request in await future for p in per_request]
            await loop.call(prefill.pop_completion, rid)
            for _ in range(500):  # the last pins go between two steps, once their copies are done
                if not any(await loop.call(lambda: list(prefill.block_pool.ref_counts))):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the pins of the streamed blocks were never released")
            return slices
        finally:
            await loop.stop()

    slices = asyncio.run(run())
    num_layers = prefill.runner.kv_spec.num_layers
    assert len(slices) == 5 * num_layers and all(p.layer is not None for p in slices)
    decode = LLMEngine(cfg)
    rid = decode.add_request(PROMPT, GREEDY, kv_payloads=slices)
    assert decode.seqs[rid].num_cached_tokens == 40  # all five blocks came in by layer
    while decode.has_unfinished():
        decode.step()
    assert decode.pop_completion(rid).token_ids == expected
