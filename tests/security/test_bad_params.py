"""Bad parameters fail only their own request, at the door (issue: one request can hurt everyone).

Each attack as it was found on a live cluster, checked where it now stops: the API's 400 naming the field,
`SamplingParams` for every other way in, the engine for a distribution that is not finite anyway, and the
conductor for a request it cannot send (nothing of it stays counted as load)."""

import asyncio
import math

import pytest
import torch

from mooncake.conductor.service import Conductor
from mooncake.config import EngineConfig
from mooncake.engine import LLMEngine
from mooncake.engine.sampler import sample
from mooncake.engine.sequence import Sequence
from mooncake.errors import InvalidRequestError
from mooncake.sampling import (MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MIN_TEMPERATURE, SEED_LIMIT,
                               SamplingParams)
from tests.api.test_api import Served, ok_body

VOCAB = 320  # the tiny model's (configs/models/tiny-llama.toml)


@pytest.fixture(scope="module")
def served(tiny_dir):
    s = Served()
    assert s.api.limits.vocab_size == VOCAB
    socks = s.fake_instances()
    yield s
    for sock in socks:
        sock.close(linger=0)
    s.close()


@pytest.mark.parametrize("extra, param", [
    ({"seed": 2**64}, "seed"),  # passed validation, failed to encode after placement: a 500 and a leak
    ({"seed": SEED_LIMIT}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": SEED_LIMIT - 2, "n": 3}, "seed"),  # choice i samples with seed + i
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": 2**64}, "max_tokens"),
])
def test_out_of_domain_parameters_get_a_400_naming_the_field(served, extra, param):
    status, reply, _ = served.request("/v1/completions", ok_body(**extra))
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error", reply


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_is_a_400(served, value):
    for field in ("temperature", "top_p"):
        raw = f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}'.encode()
        status, reply, _ = served.request("/v1/completions", raw=raw)
        assert status == 400 and reply["error"]["param"] == field, reply


def test_no_refused_request_stays_counted_as_load(served):
    """Six of these made admission refuse everyone with 429 before: each stayed in flight forever."""
    for _ in range(6):
        assert served.request("/v1/completions", ok_body(seed=2**64))[0] == 400
    assert served.conductor.flights == {}
    assert all(not i.request_ids for i in served.conductor.registry.instances.values())


def test_a_request_that_cannot_be_sent_leaves_nothing_behind(served):
    """All or nothing at the conductor, whatever got past validation: nothing is counted until its
    messages are built, and a failure unwinds what was."""
    params = SamplingParams(max_tokens=4, seed=1)
    object.__setattr__(params, "seed", 2**64)  # past every check: the wire codec cannot take it

    async def submit():
        return await served.door.submit([5, 6, 7], params)
    with pytest.raises(OverflowError):
        asyncio.run_coroutine_threadsafe(submit(), served.loop).result(30)
    conductor: Conductor = served.conductor
    assert served.door.streams == {}
    assert conductor.flights == {}
    assert all(not i.request_ids for i in conductor.registry.instances.values())
    # NOTE: counted by the API process that ended it; the conductor counts only requests it placed or refused
    own = served.door.metrics.exposition().decode()
    assert any(line.startswith("mooncake_api_requests_total{") and 'outcome="error"' in line and line.endswith(" 1.0")
               for line in own.splitlines()), own
    in_flight = conductor.metrics.exposition().decode()
    assert not any(line.startswith("mooncake_requests_in_flight{") and not line.endswith(" 0.0")
                   for line in in_flight.splitlines())


def test_sampling_params_check_their_domain_on_every_way_in():
    for kwargs, param in [({"seed": 2**64}, "seed"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
                          ({"top_k": 2**64}, "top_k"), ({"top_k": True}, "top_k"),
                          ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
                          ({"temperature": -0.5}, "temperature"), ({"top_p": math.nan}, "top_p"),
                          ({"max_tokens": 2**40}, "max_tokens"), ({"ignore_eos": 1}, "ignore_eos"),
                          ({"stop": ("a",) * 5}, "stop"), ({"stop_token_ids": tuple(range(200))}, "stop_token_ids"),
                          ({"stop_token_ids": (2**40,)}, "stop_token_ids"), ({"logprobs": 21}, "logprobs")]:
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(**kwargs)
        assert caught.value.param == param, kwargs


def test_a_vanishing_temperature_is_raised_to_the_floor_as_vllm_does():
    assert SamplingParams(temperature=1e-300).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0).temperature == 0 and SamplingParams(temperature=0.7).temperature == 0.7


def test_sample_gives_no_token_to_a_row_whose_distribution_is_not_finite():
    logits = torch.randn(3, VOCAB)
    logits[1, 7] = math.nan
    seqs = [Sequence(f"r{i}", [1], SamplingParams()) for i in range(3)]
    tokens = sample(logits, seqs)
    assert tokens[1] is None and tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    hot = SamplingParams(temperature=1.0)
    object.__setattr__(hot, "temperature", 1e-300)  # what the floor now prevents: logits / 1e-300 overflow
    seq = Sequence("hot", [1], hot, generator=torch.Generator().manual_seed(0))
    assert sample(torch.randn(1, VOCAB), [seq]) == [None]


@pytest.fixture
def engine(tiny_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), block_size=8, prefill_chunk=16, num_kv_blocks=64))
    assert engine.runner.vocab_size == VOCAB
    return engine


def test_a_non_finite_distribution_fails_that_sequence_alone(engine):
    """It failed the whole engine step before: every request in the engine ended with an error."""
    victim_params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate([[3, 4, 5, 6]], victim_params)[0].token_ids
    poison = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    object.__setattr__(poison, "temperature", 1e-300)
    engine.add_request([3, 4, 5, 6], victim_params, "victim")
    engine.add_request([9, 9, 9, 9, 9, 9, 9, 9, 9, 9], poison, "poison")
    failed = []
    while engine.has_unfinished():
        engine.step()
        failed += engine.drain_failed()
    assert [request_id for request_id, _ in failed] == ["poison"] and "not finite" in failed[0][1]
    assert "poison" not in engine.seqs
    assert engine.pop_completion("victim").token_ids == alone
    assert engine.block_pool.num_used == 0  # the failed sequence's blocks are free again


def test_the_engine_refuses_top_k_and_stop_token_ids_beyond_its_vocabulary(engine):
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request([1, 2, 3], SamplingParams(top_k=VOCAB + 1))
    assert caught.value.param == "top_k"
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request([1, 2, 3], SamplingParams(stop_token_ids=(VOCAB,)))
    assert caught.value.param == "stop_token_ids"
    assert not engine.seqs
