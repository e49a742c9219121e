"""CPP stages handing activations on over a transport (mooncake/prefill/stage_link.py): each stage's
transport serves a StageInbox; 2 and 3 stages over in-process and TCP transports give one engine's first
token; a stage that never hears from the one before fails by its deadline, naming the request and
stage; a full inbox refuses a chunk and the sender's error names the peer."""

import asyncio
import time

import pytest
import torch

from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine, SamplingParams
from mooncake.engine.stage import PipelineStage, stage_layers
from mooncake.hidden_payload import encode_hidden
from mooncake.prefill.stage_link import StageInbox, chunk_key, run_stage
from mooncake.registry import load_backend
from mooncake.transfer.contract import TransferError
from mooncake.transfer.modelled import ModelledNetwork
from tests.conftest import REAL, TINY
from tests.cpp_harness import run_group


# NOTE: SmolLM2's groups over transports run in the slow tier (about 30 s of make test): the tiny model covers
# every path here, and SmolLM2's pipeline parity is tests/engine/test_stage.py's (slow tier too).
@pytest.fixture(scope="module", params=[TINY, pytest.param(REAL, marks=[pytest.mark.real_model, pytest.mark.slow])])
def cfg(request):
    from mooncake.models.fetch import fetch_model
    return EngineConfig(model=str(fetch_model(request.param)), block_size=16, prefill_chunk=24, num_kv_blocks=64)


def make_transport(name):
    cls = load_backend("transports", name)
    return cls() if name == "inproc" else cls(host="127.0.0.1")


async def on_thread(stage, *args):
    return await asyncio.to_thread(stage.run, *args)


async def group_over(name, cfg, stages, ids, chunk):
    engines = [LLMEngine(cfg) for _ in range(stages)]
    group = [PipelineStage(e, layers) for e, layers in zip(engines, stage_layers(engines[0].runner.kv_spec.num_layers, stages))]
    free = [e.block_pool.num_free for e in engines]
    logits = await run_group(group, [make_transport(name) for _ in group], "r1", ids, chunk, timeout_s=60)
    for stage, before in zip(group, free):
        stage.end("r1")
        assert stage.engine.block_pool.num_free == before
    return logits


@pytest.mark.parametrize("name", ["inproc", "tcp"])
@pytest.mark.parametrize("stages", [2, 3])
def test_stages_over_a_transport_give_one_engines_first_token(cfg, name, stages):
    single = LLMEngine(cfg)
    ids = single.tokenizer("Pipeline stages hand their activations on over the wire, chunk by chunk. " * 4)["input_ids"][:60]
    (alone,) = single.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
    logits = asyncio.run(group_over(name, cfg, stages, ids, chunk=cfg.prefill_chunk))
    assert logits.shape == (1, single.runner.vocab_size)
    assert int(logits.argmax()) == alone.token_ids[0]


def test_a_stage_computes_on_while_its_sends_are_on_their_way_each_after_its_hop_time(cfg):
    """A stage starts its next chunk as soon as it has handed the last one on, not once the next stage
    has it; each chunk arrives after its hop time (an emulated model's modelled activations, taken by a
    modelled-network transport: 1 s for a chunk of 8 tokens here)."""
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(0, 1))
    stage.begin("r5", list(range(1, 25)))
    computed, arrived = [], []

    async def compute(stage, *args):
        out = await asyncio.to_thread(stage.run, *args)
        computed.append(time.monotonic())
        return out

    async def go():
        receiver, sender = make_transport("inproc"), ModelledNetwork(make_transport("inproc"), 0.0, 1, 1 / 8)
        inbox = StageInbox()
        put = inbox.put_block
        inbox.put_block = lambda key, data, checksum=None: arrived.append(time.monotonic()) or put(key, data, checksum)
        address = await receiver.start(inbox)
        await sender.start()
        try:
            await run_stage(stage, 0, "r5", [8, 8, 8], compute, None, sender, address, time.monotonic() + 30)
        finally:
            await sender.stop()
            await receiver.stop()
        return inbox

    inbox = asyncio.run(go())
    stage.end("r5")
    assert len(computed) == len(arrived) == 3
    assert computed[2] < arrived[0]  # all three computed while the first was still on its way
    assert all(a - c >= 1.0 for c, a in zip(computed, arrived))
    assert len(inbox._chunks) == 3


def test_a_stage_that_hears_nothing_fails_by_its_deadline(cfg):
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(1, engine.runner.kv_spec.num_layers))
    stage.begin("r7", [1, 2, 3, 4, 5])

    async def go():
        return await run_stage(stage, 1, "r7", [5], on_thread, StageInbox(), None, None, time.monotonic() + 0.3)
    started = time.monotonic()
    with pytest.raises(TransferError, match="request r7 stage 1 chunk 0: nothing from the previous stage"):
        asyncio.run(go())
    assert time.monotonic() - started < 5
    stage.end("r7")


def test_a_full_inbox_refuses_a_chunk_and_the_sender_names_the_peer(cfg):
    engine = LLMEngine(cfg)
    stage = PipelineStage(engine, range(0, 1))
    stage.begin("r9", [1, 2, 3, 4, 5])

    async def go():
        receiver, sender = make_transport("inproc"), make_transport("inproc")
        address = await receiver.start(StageInbox(max_bytes=64))
        await sender.start()
        try:
            await run_stage(stage, 0, "r9", [5], on_thread, None, sender, address, time.monotonic() + 30)
        finally:
            await receiver.stop()
    with pytest.raises(TransferError, match=r"r9 stage 0 chunk 0: stage 1 at inproc://\S+ refused .*inbox is full"):
        asyncio.run(go())
    stage.end("r9")


def test_an_inbox_hands_each_chunk_once_and_drops_an_ended_requests_chunks():
    async def go():
        inbox = StageInbox()
        data = encode_hidden(torch.ones(2, 3))
        assert inbox.put_block(chunk_key("a", 1, 0), data) is None
        assert inbox.num_bytes == len(data)
        waiting = asyncio.ensure_future(inbox.take(chunk_key("a", 1, 1), 5, "a"))
        await asyncio.sleep(0)
        inbox.put_block(chunk_key("a", 1, 1), data)  # handed straight to the waiter
        assert await waiting == data
        assert await inbox.take(chunk_key("a", 1, 0), 5, "a") == data
        assert inbox.num_bytes == 0
        inbox.put_block(chunk_key("b", 1, 0), data)
        inbox.drop([chunk_key("b", 1, j) for j in range(3)])
        assert inbox.num_bytes == 0
        with pytest.raises(TransferError):
            await inbox.take(chunk_key("b", 1, 0), 0.05, "b")
    asyncio.run(go())
    assert chunk_key("a", 1, 0) != chunk_key("a", 2, 0) != chunk_key("a", 1, 1) != chunk_key("b", 1, 0)


def test_a_failed_stage_ends_the_group_with_its_error_and_the_others_stop_waiting(cfg):
    engines = [LLMEngine(cfg) for _ in range(2)]
    group = [PipelineStage(e, layers) for e, layers in zip(engines, stage_layers(engines[0].runner.kv_spec.num_layers, 2))]

    def broken(*args):
        raise RuntimeError("stage 0 lost its device")
    group[0].run = broken
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="lost its device"):
        asyncio.run(run_group(group, [make_transport("tcp") for _ in group], "r1", [1, 2, 3, 4, 5] * 10, 16,
                              timeout_s=60))
    assert time.monotonic() - started < 30  # stage 1 did not wait out its deadline
    for stage in group:
        stage.end("r1")


def test_a_chunk_nobody_takes_expires():
    async def go():
        inbox = StageInbox(ttl_s=0.05)
        data = encode_hidden(torch.ones(4))
        inbox.put_block(chunk_key("gone", 1, 0), data)  # its request ended here before it came
        await asyncio.sleep(0.1)
        inbox.put_block(chunk_key("next", 1, 0), data)
        assert inbox.num_bytes == len(data)
        with pytest.raises(TransferError):
            await inbox.take(chunk_key("gone", 1, 0), 0.05, "gone")
        assert await inbox.take(chunk_key("next", 1, 0), 1, "next") == data
    asyncio.run(go())


def test_a_chunk_the_engine_does_not_compute_in_time_fails_by_the_deadline(cfg):
    """A chunk waits for its turn in the engine's steps within the stage's deadline too."""
    stage = PipelineStage(LLMEngine(cfg), range(0, 1))
    stage.begin("r8", [1, 2, 3, 4, 5])
    cancelled = []

    async def never(*_args):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)  # the chunk leaves the engine's queue (EngineLoop.run_stage_chunk)
            raise

    async def go():
        return await run_stage(stage, 0, "r8", [5], never, None, None, None, time.monotonic() + 0.3)
    started = time.monotonic()
    with pytest.raises(TransferError, match="request r8 stage 0 chunk 0: not computed by the deadline"):
        asyncio.run(go())
    assert time.monotonic() - started < 5 and cancelled == [True]
    stage.end("r8")
