import msgpack
import pytest

from mooncake import messages as m
from mooncake.errors import InvalidRequestError
from mooncake.sampling import WireSampling

SAMPLES = [
    m.Hello(),
    m.HelloReply(node_id="cache-0", transport="tcp", data_address="tcp://127.0.0.1:1", events_address="tcp://x:2"),
    m.Exists(keys=[1, 2**64 - 1]),
    m.ExistsReply(tiers=["dram", None, "ssd"]),
    m.MatchPrefix(keys=[5, 6]),
    m.MatchPrefixReply(tiers=["dram"]),
    m.Remove(keys=[3]),
    m.RemoveReply(removed=[True, False]),
    m.Stats(),
    m.StatsReply(stats={"hits": {"dram": 3}, "misses": 1}),
    m.StoreEvents(node_id="cache-1", events=[("add", 7, "dram"), ("evict", 8, None)], epoch="e1", seq=4),
    m.Snapshot(),
    m.SnapshotReply(node_id="cache-1", epoch="e1", seq=3, keys=[7, 2**64 - 1]),
    m.ErrorReply(error="bad"),
    m.Register(instance_id="p0", role="prefill", model_id="tiny-abc", block_size=64, kv_dtype="float32",
               num_kv_blocks=128),
    m.RegisterReply(accepted=False, error="wrong model", heartbeat_interval_s=0.25),
    m.Leave(instance_id="d1"),
    m.Heartbeat(instance_id="d0", num_waiting=1, num_running=3, num_kv_blocks_used=9, num_kv_blocks=100,
                step_samples=[m.StepSample(3, 900, 0.02)], emulated_steps=[m.EmulatedStep(0.05, 0.06)],
                cache=m.CacheChanges(added=[2**63], evicted=[4], is_snapshot=True), seq=5),
    m.Resync(),
    m.Prefill(request_id="r1", token_ids=[1, 2, 3], block_hashes=[11], sampling=WireSampling(max_tokens=4),
              decode_id="d0", decode_transport="shm", decode_address="shm://x", reuse_blocks=1, deadline_s=9.0),
    m.PrefillStage(request_id="r1", token_ids=[1, 2, 3], block_hashes=[11], sampling=WireSampling(max_tokens=4), stage=1,
                   num_stages=2, chunk_tokens=2048, decode_id="d0", decode_address="tcp://127.0.0.1:9001"),
    m.PrefillDone(request_id="r1", first_token=7, finish_reason=None, num_cached_tokens=64,
                  num_computed_tokens=3, num_kv_blocks_sent=2, kv_bytes=4096, kv_seconds=0.01,
                  prefill_seconds=0.2, compute_seconds=0.1, fetched_bytes=10, fetch_seconds=0.1),
    m.Decode(request_id="r1", token_ids=[1, 2, 3, 7], block_hashes=[11], sampling=WireSampling(max_tokens=3)),
    m.Tokens(request_id="r1", token_ids=[8, 9], finish_reason="length"),
    m.StepTokens(reports=[m.Tokens(request_id="r1", token_ids=[8]), m.Tokens(request_id="r2", token_ids=[5],
                                                                             finish_reason="stop")]),
    m.Cancel(request_id="r1", block_hashes=[11]),
    m.RequestFailed(request_id="r1", error="out of KV blocks", is_invalid=True),
    m.Place(request_id="r1.1", token_ids=[1, 2, 3], block_hashes=[], sampling=WireSampling(max_tokens=4), admit=False,
            avoid=["d0"], deadline_s=30.0, reply_to="tcp://127.0.0.1:9", moved_from="r1"),
    m.Placed(request_id="r1", prefill_ids=["p0", "p1"], decode_id="d0", reuse_blocks=2, predicted_ttft_s=0.5,
             predicted_tbt_s=0.05),
    m.Placed(request_id="r2", refusal="rejected", reason="ttft", error="over the SLO", retry_after_s=2.0),
    m.HandOff(done=m.PrefillDone(request_id="r1", first_token=7, finish_reason=None, num_cached_tokens=0,
                                 num_computed_tokens=3, num_kv_blocks_sent=0, kv_bytes=0, kv_seconds=0.0,
                                 prefill_seconds=0.1, compute_seconds=0.1),
              decode_id="d0", token_ids=[1, 2, 3, 7], block_hashes=[], sampling=WireSampling(max_tokens=3), go_on=True,
              pool_first_block=1, reply_to="tcp://127.0.0.1:9"),
    m.LegEnded(request_id="r1", is_finished=True, outcome="ok", num_prompt_tokens=3, num_completion_tokens=4,
               ttft_s=0.2, e2e_s=1.0, gap_counts=[0, 2, 1], gap_sum_s=0.03, migration=""),
    m.LegLost(request_id="r1", error="decode instance d0 stopped responding", suspects=["d0"]),
    m.Cluster(),
    m.ClusterReply(health={"decode": ["d0"], "mode": "disaggregated"}, metrics="# HELP x\n"),
    m.Register(instance_id="api-1", role="api", model_id="tiny-abc", block_size=64, kv_dtype="float32",
               data_address="tcp://127.0.0.1:9", legs=[m.HeldLeg("r1", "d0", 120, 30)]),
    m.Heartbeat(instance_id="d0", decode=m.DecodeLoad(num_inbox_blocks=2, progress=[m.LegProgress("r1", 12),
                                                                                    m.LegProgress("r2", 0)])),
]


def test_every_registered_message_has_a_sample():
    assert {type(s).TAG for s in SAMPLES} == set(m._TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).TAG)
def test_round_trip(msg):
    back = m.decode(m.encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("frame, match", [
    (b"\xc1", "not msgpack"),
    (b"\x93\x01\x02\x03", "Expected `object`"),
    (b"\x82\xa1t\xa6nosuch\xa1v\x01", "Invalid value 'nosuch'"),
    (b"\x82\xa1t\xa5hello\xa1v\x08", "version 8"),
    (b"\x83\xa1t\xa6remove\xa1v\x01\xa3bad\x01", "unknown field `bad`"),
    (b"\x82\xa1t\xa6remove\xa1v\x01", "missing required field `keys`"),
])
def test_malformed_frames_are_message_errors(frame, match):
    with pytest.raises(m.MessageError, match=match):
        m.decode(frame)


@pytest.mark.parametrize("fields, where", [
    ({"t": "leave", "instance_id": ["p0"]}, "$.instance_id"),  # once killed the conductor's receive loop
    ({"t": "exists", "keys": [[1, 2], [3]]}, "$.keys[0]"),  # once killed a cache node's control loop
    ({"t": "heartbeat", "instance_id": "d0", "step_samples": [[1, 2]]}, "$.step_samples[0]"),
    ({"t": "heartbeat", "instance_id": "d0", "cache": {"added": ["x"]}}, "$.cache.added[0]"),
    ({"t": "heartbeat", "instance_id": "d0", "decode": {"progress": [["r1"]]}}, "$.decode.progress[0]"),
    ({"t": "store_events", "node_id": "c", "events": [["add", "key", "dram"]]}, "$.events[0][1]"),
    ({"t": "prefill_done", "request_id": "r", "first_token": "7"}, "$.first_token"),
    ({"t": "register", "instance_id": "p0", "role": "prefill", "model_id": "m", "block_size": "64"},
     "$.block_size"),
    ({"t": "decode", "request_id": "r", "token_ids": [1], "block_hashes": [], "sampling": {"top_k": "5"}},
     "$.sampling.top_k"),
    ({"t": "decode", "request_id": "r", "token_ids": [1], "block_hashes": [], "sampling": {"stop": ["x"]}},
     "$.sampling"),  # stop strings stay with the API process: an unknown field
    ({"t": "decode", "request_id": "r", "token_ids": [1], "block_hashes": [], "sampling": {"seed": 1.5}},
     "$.sampling.seed"),
])
def test_well_formed_but_ill_typed_messages_are_message_errors(fields, where):
    frame = msgpack.packb({"v": m.VERSION, **fields})
    with pytest.raises(m.MessageError, match=where.replace("$", r"\$").replace("[", r"\[")):
        m.decode(frame)


def test_sampling_crosses_the_wire_as_the_params_it_came_from_less_what_stays_with_the_api():
    """wire_sampling and WireSampling.params are inverse but for stop strings (matched by the API process
    on text) and a resumed leg's prompt logprobs (its prompt ends with tokens already generated)."""
    from mooncake.sampling import SamplingParams, wire_sampling

    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1, stop=("END",),
                            stop_token_ids=(5, 6), logprobs=3, prompt_logprobs=2, grammar="start: /a+/",
                            prefix_root=2**64 - 1)
    msg = m.decode(m.encode(m.Decode(request_id="r", token_ids=[1], block_hashes=[],
                                     sampling=wire_sampling(params, 9))))
    assert msg.sampling.params() == SamplingParams(**{**params.__dict__, "stop": ()})
    resumed = wire_sampling(params, 4, resumed=3).params()
    assert (resumed.max_tokens, resumed.grammar_done, resumed.prompt_logprobs) == (4, 3, None)
    with pytest.raises(InvalidRequestError, match="top_p"):
        WireSampling(top_p=1.5).params()  # well typed, out of bounds: refused when the params are built
