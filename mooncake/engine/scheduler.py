"""Continuous batching: each step picks which sequences compute how many tokens, under a token budget.

Running sequences go first (a decoding one takes 1 token, one still in prefill a chunk), then waiting
sequences are admitted in arrival order while budget, sequence slots and free blocks last. With serial
prefill (`engine.prefill_batching`) a step holds at most one prompt's chunk, the earliest's, so a
prompt's first token never waits for a later prompt's tokens. On admission a sequence reuses the longest
run of its leading blocks found in the local prefix cache. When blocks run out, the newest running
sequence is preempted: its blocks are freed (they stay findable by hash) and it is recomputed later.

A CPP stage's chunk (engine/stage.py `StageChunk`, other layers than the model's) cannot join a batch: it
takes a step of its own (`stage_turn`), first come, first served with the batch's prompts by their
requests' arrival, never two steps in a row while sequences decode, and computes at most the step's token
budget (a longer chunk takes several steps)."""

from collections import deque

from mooncake.config import EngineConfig
from mooncake.engine.batch import ScheduledSeq
from mooncake.engine.block_pool import BlockPool
from mooncake.engine.sequence import Sequence, SeqStatus
from mooncake.errors import InvalidRequestError


class Scheduler:
    def __init__(self, config: EngineConfig, block_pool: BlockPool, serial_prefill: bool = False):
        self.block_size = config.block_size
        self.prefill_chunk = config.prefill_chunk
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.enable_prefix_cache = config.enable_prefix_cache
        self.serial_prefill = serial_prefill
        self.block_pool = block_pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stage_chunks: list = []  # CPP stages' chunks waiting for steps (StageChunk), in arrival order
        self.stage_finished: list = []  # those done or failed since the last drain_stage_chunks
        self._stage_ran_last = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.stage_chunks)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        # NOTE: serial prefill admits a prompt only when none is running, so one at most is running.
        prefilling = False  # a prompt's chunk is in this step
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, self.prefill_chunk, budget)
            if n == 0:
                i += 1
                continue
            if not self._reserve(seq, n):
                # NOTE: the victim is the newest sequence; everything before index i is already scheduled.
                self._preempt(self.running.pop())
                continue
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prefilling = prefilling or _prefilling(seq)
            i += 1
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not (self.serial_prefill and prefilling)):
            seq = self.waiting[0]
            # NOTE: a prompt whose logprobs are wanted computes every token: cached ones have no logits
            if not seq.block_table and self.enable_prefix_cache and not seq.wants_prompt_logprobs:
                self._reuse_prefix(seq)
            n = min(seq.num_uncomputed_tokens, self.prefill_chunk, budget)
            if not self._reserve(seq, n):
                self._free(seq)  # wait for running sequences to finish; cached blocks stay findable
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prefilling = True
        return scheduled

    def stage_turn(self, scheduled: list[ScheduledSeq]):
        """The stage chunk that takes this step instead of `scheduled` (whose blocks stay reserved for a
        later step), or None: the earliest-arrived chunk, unless a prompt in `scheduled` arrived before it,
        or it took the last step and `scheduled` has sequences decoding (their next tokens wait)."""
        chunk = min(self.stage_chunks, key=lambda c: c.arrival_s, default=None)
        prompts = [item.seq.arrival_s for item in scheduled if _prefilling(item.seq)]
        if chunk is None or prompts and min(prompts) < chunk.arrival_s \
                or self._stage_ran_last and len(prompts) < len(scheduled):
            self._stage_ran_last = False
            return None
        self._stage_ran_last = True
        return chunk

    def on_stage_computed(self, chunk) -> None:
        """After a step of `chunk`: once finished, it leaves the queue for `drain_stage_chunks`."""
        if chunk.finished:
            self.stage_chunks.remove(chunk)
            self.stage_finished.append(chunk)

    def drop_stage_chunks(self, stage, request_id: str, why: str) -> None:
        """`stage`'s queued chunks of `request_id` fail (InvalidRequestError `why`) and leave the queue."""
        for chunk in [c for c in self.stage_chunks if c.stage is stage and c.request_id == request_id]:
            self.drop_stage_chunk(chunk, why)

    def drop_stage_chunk(self, chunk, why: str) -> None:
        """`chunk`, if still queued, fails (InvalidRequestError `why`) and leaves the queue."""
        if chunk in self.stage_chunks:
            chunk.error = chunk.error or InvalidRequestError(why)
            self.on_stage_computed(chunk)

    def drain_stage_chunks(self) -> list:
        """The stage chunks finished (or failed) since the last call."""
        finished, self.stage_finished = self.stage_finished, []
        return finished

    def on_computed(self, scheduled: list[ScheduledSeq]) -> None:
        """After the forward pass: advance each sequence and publish its newly full blocks by hash."""
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            seq.num_forwarded_tokens += item.num_new_tokens
            num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
            while seq.num_registered_blocks < num_full:
                k = seq.num_registered_blocks
                self.block_pool.register(seq.block_table[k], seq.block_hashes[k])
                seq.num_registered_blocks += 1

    def finish(self, seq: Sequence, reason: str, free: bool = True) -> None:
        """Take `seq` out of scheduling; with `free=False` it keeps its blocks until `release()`."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def release(self, seq: Sequence) -> None:
        """Free the blocks a finished sequence kept (see `finish(free=False)`)."""
        self._free(seq)

    def _reuse_prefix(self, seq: Sequence) -> None:
        # At least one token must be computed to get logits, so the last token's block is never reused.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = self.block_pool.match_prefix(seq.block_hashes[:max_blocks])
        self.block_pool.acquire(blocks)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_registered_blocks = len(blocks)
        seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)

    def _reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if needed <= 0:
            return True
        blocks = self.block_pool.allocate(needed)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        self.block_pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0


def _prefilling(seq: Sequence) -> bool:
    """Whether `seq` still computes its prompt (or recomputes after preemption), not one decode token."""
    return seq.num_uncomputed_tokens > 1 or not seq.output_token_ids
