from mooncake.config import EngineConfig
from mooncake.engine.block_pool import BlockPool
from mooncake.sampling import SamplingParams
from mooncake.engine.scheduler import Scheduler
from mooncake.engine.sequence import Sequence, SeqStatus


def make(num_blocks=64, serial_prefill=False, **overrides):
    cfg = EngineConfig(block_size=4, prefill_chunk=8, max_num_batched_tokens=12, max_num_seqs=3, **overrides)
    return Scheduler(cfg, BlockPool(num_blocks), serial_prefill)


def seq(name, n):
    return Sequence(seq_id=name, prompt_token_ids=list(range(n)), params=SamplingParams())


def run_step(sched):
    """Schedule and pretend the forward pass ran; sampled sequences get one new token."""
    items = sched.schedule()
    sched.on_computed(items)
    for item in items:
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_token_ids.append(0)
    return {item.seq.seq_id: item.num_new_tokens for item in items}


def test_prefill_is_chunked_and_budget_respected():
    sched = make()
    sched.add(seq("a", 20))
    sched.add(seq("b", 20))
    assert run_step(sched) == {"a": 8, "b": 4}
    assert run_step(sched) == {"a": 8, "b": 4}
    assert run_step(sched) == {"a": 4, "b": 8}  # a finishes its prompt; b gets the rest of the budget
    assert run_step(sched) == {"a": 1, "b": 4}  # a decodes, b completes its prompt


def test_serial_prefill_runs_one_prompt_at_a_time_and_never_tops_up_a_last_chunk():
    sched = make(serial_prefill=True)
    sched.add(seq("a", 20))
    sched.add(seq("b", 20))
    assert run_step(sched) == {"a": 8}
    assert run_step(sched) == {"a": 8}
    assert run_step(sched) == {"a": 4}  # a's first token does not wait for any of b's tokens
    assert run_step(sched) == {"a": 1, "b": 8}  # decode tokens still batch beside the next prompt
    sched.add(seq("c", 3))
    assert run_step(sched) == {"a": 1, "b": 8}  # c waits for b, the earlier prompt
    assert run_step(sched) == {"a": 1, "b": 4}
    assert run_step(sched) == {"a": 1, "b": 1, "c": 3}


def test_serial_prefill_recomputes_a_preempted_sequence_alone():
    sched = make(num_blocks=4, serial_prefill=True)
    a, b = seq("a", 7), seq("b", 7)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {"a": 7}
    assert run_step(sched) == {"a": 1, "b": 7}  # 2 blocks each: the pool is full
    assert run_step(sched) == {"a": 1}  # a's 9th token needs a third block: b, the newest, is preempted
    assert b.num_preemptions == 1 and b.status is SeqStatus.WAITING


def test_new_requests_join_running_decodes():
    sched = make()
    sched.add(seq("a", 3))
    run_step(sched)
    sched.add(seq("b", 5))
    assert run_step(sched) == {"a": 1, "b": 5}
    assert run_step(sched) == {"a": 1, "b": 1}


def test_max_num_seqs_limits_running():
    sched = make()
    for i in range(5):
        sched.add(seq(str(i), 2))
    assert set(run_step(sched)) == {"0", "1", "2"}
    assert len(sched.waiting) == 2


def test_out_of_blocks_preempts_newest_and_recomputes_it():
    sched = make(num_blocks=4)
    a, b = seq("a", 7), seq("b", 7)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == {"a": 7, "b": 5}  # 2 blocks each: the pool is full
    assert run_step(sched) == {"a": 1, "b": 2}
    # a's 9th token needs a third block: b (the newest) is preempted, and cannot come back yet.
    assert run_step(sched) == {"a": 1}
    assert b.num_preemptions == 1 and b.status is SeqStatus.WAITING and b.block_table == []
    assert b.output_token_ids == [0]  # what it generated is kept and recomputed, not lost
    sched.finish(a, "stop")
    assert run_step(sched) == {"b": 8}  # prompt + its first token, recomputed
    assert sched.block_pool.num_free == 2


def test_prefix_reuse_skips_cached_blocks_but_not_the_last_token():
    from mooncake.hashing import hash_blocks
    sched = make()
    first = seq("a", 8)
    first.block_hashes = hash_blocks(first.prompt_token_ids, 4, b"ns")
    sched.add(first)
    run_step(sched)
    sched.finish(first, "stop")
    again = seq("b", 8)
    again.block_hashes = list(first.block_hashes)
    sched.add(again)
    # Both blocks are cached, but logits need one computed token: only block 0 is reused.
    assert run_step(sched) == {"b": 4}
    assert again.num_cached_tokens == 4


def test_auto_prefill_batching_is_serial_on_prefill_instances_only():
    from mooncake.config import load_config
    from mooncake.decode.worker import DecodeWorker
    from mooncake.prefill.worker import PrefillWorker

    auto = load_config(None)
    assert auto.engine.prefill_batching == "auto"
    assert PrefillWorker(auto).engine_config().prefill_batching == "serial"
    assert DecodeWorker(auto).engine_config().prefill_batching == "budget"  # decode and colocated instances
    chosen = load_config(None, {"engine.prefill_batching": "budget"})
    assert PrefillWorker(chosen).engine_config().prefill_batching == "budget"


class _Chunk:
    """A CPP stage's chunk as the scheduler sees one (engine/stage.py StageChunk): its request's arrival,
    and finished once its tokens are computed."""

    def __init__(self, request_id, arrival_s, num_tokens):
        self.stage, self.request_id, self.arrival_s, self.num_tokens = "stage", request_id, arrival_s, num_tokens
        self.done, self.error = 0, None

    @property
    def finished(self):
        return self.error is not None or self.done >= self.num_tokens


def stage_or_batch(sched):
    """One engine step: a stage chunk's (it computes its whole budget) or the batch's."""
    items = sched.schedule()
    chunk = sched.stage_turn(items)
    if chunk is None:
        sched.on_computed(items)
        for item in items:
            if item.seq.num_computed_tokens == item.seq.num_tokens:
                item.seq.output_token_ids.append(0)
        return {item.seq.seq_id: item.num_new_tokens for item in items}
    chunk.done += min(chunk.num_tokens - chunk.done, sched.max_num_batched_tokens)
    sched.on_stage_computed(chunk)
    return {f"stage {chunk.request_id}": chunk.done}


def test_a_stage_chunk_takes_steps_in_its_requests_turn_first_come_first_served():
    sched = make(serial_prefill=True)
    a, b = seq("a", 20), seq("b", 20)
    a.arrival_s, b.arrival_s = 1.0, 3.0
    sched.add(a)
    sched.add(b)
    chunk = _Chunk("s", 2.0, 30)  # arrived between a and b: after a's prompt, before b's
    sched.stage_chunks.append(chunk)
    assert stage_or_batch(sched) == {"a": 8}  # a arrived first
    assert stage_or_batch(sched) == {"a": 8}
    assert stage_or_batch(sched) == {"a": 4}
    # a decodes now: the chunk and a's decode steps alternate, and b waits for the chunk
    assert stage_or_batch(sched) == {"stage s": 12}  # at most the step's token budget
    assert stage_or_batch(sched) == {"a": 1, "b": 8}  # b was admitted by the step the chunk took; a decodes
    assert stage_or_batch(sched) == {"stage s": 24}
    assert stage_or_batch(sched) == {"a": 1, "b": 8}
    assert stage_or_batch(sched) == {"stage s": 30}
    assert chunk.finished and sched.stage_chunks == [] and sched.drain_stage_chunks() == [chunk]
    assert sched.drain_stage_chunks() == []
    assert stage_or_batch(sched) == {"a": 1, "b": 4}


def test_a_stage_chunk_alone_runs_at_once_and_a_dropped_one_fails_for_its_caller():
    sched = make()
    assert not sched.has_work()
    first, second = _Chunk("s", 1.0, 4), _Chunk("t", 2.0, 4)
    sched.stage_chunks += [second, first]
    assert sched.has_work()
    assert stage_or_batch(sched) == {"stage s": 4}  # the earlier request's, whatever the queue's order
    sched.drop_stage_chunks("stage", "t", "request 't' left the stage")
    assert sched.stage_chunks == [] and not sched.has_work()
    assert sched.drain_stage_chunks() == [first, second]
    assert "left the stage" in str(second.error) and second.done == 0
