"""Whole CPP groups in one process, for tests and benchmarks (scripts/bench_cpp.py): the stages of a
group as a prefill instance's would run them, without the instances.

- `run_local_pipeline`: each stage (engine/stage.py PipelineStage) on a thread of its own, the chunks' hidden
  states crossing each boundary as bytes.
- `run_group`: each stage on a transport of its own, as prefill/stage_link.py's `run_stage` runs it."""

import asyncio
import queue
import threading
import time

import torch

from mooncake.engine.stage import PipelineStage
from mooncake.hidden_payload import decode_hidden, encode_hidden
from mooncake.kv_payload import KVPayload
from mooncake.prefill.stage_link import Stage, StageInbox, run_stage
from mooncake.transfer.contract import Transport


def run_local_pipeline(stages: list[PipelineStage], request_id: str, prompt_token_ids: list[int],
                       chunk_tokens: int, timeout_s: float = 600.0, prefix: list[KVPayload] = ()) -> torch.Tensor:
    """A whole group in one process (tests, benchmarks): each stage on a thread of its own, the chunks'
    hidden states crossing each boundary as bytes (`encode_hidden`); the logits of the prompt's last
    token ([1, vocab]). `prefix`: the prompt's cached leading blocks, whole, for every stage's `begin`. The
    stages keep the prompt's blocks (for `export`) until their `end`."""
    for stage in stages:
        stage.begin(request_id, prompt_token_ids, prefix)
    n, start = len(prompt_token_ids), stages[0].jobs[request_id].done
    sizes = [min(chunk_tokens, n - i) for i in range(start, n, chunk_tokens)]
    inboxes = [queue.Queue() for _ in range(len(stages) + 1)]
    for size in sizes:
        inboxes[0].put((size, None))

    def work(k: int) -> None:
        last = k == len(stages) - 1
        try:
            for _ in sizes:
                size, data = inboxes[k].get(timeout=timeout_s)
                if isinstance(data, BaseException):  # a stage before failed: pass it on to the caller
                    raise data
                hidden = None if data is None else decode_hidden(data)  # `run` moves it to the device
                out = stages[k].run(request_id, size, hidden)
                inboxes[k + 1].put((size, out if last else encode_hidden(out)))
        except BaseException as exc:  # noqa: BLE001 - handed on, and raised by the caller
            inboxes[k + 1].put((0, exc))

    threads = [threading.Thread(target=work, args=(k,), name=f"cpp-stage-{k}", daemon=True) for k in range(len(stages))]
    for thread in threads:
        thread.start()
    logits = None
    for _ in sizes:
        _, out = inboxes[-1].get(timeout=timeout_s)
        if isinstance(out, BaseException):
            raise out
        logits = out
    for thread in threads:
        thread.join(timeout_s)
    return logits


async def run_group(stages: list[Stage], transports: list[Transport], request_id: str,
                    prompt_token_ids: list[int], chunk_tokens: int, timeout_s: float = 600.0) -> torch.Tensor:
    """A whole group in one process (tests, benchmarks), each stage on a transport of its own (not yet
    started) serving its inbox, each chunk computed on a thread: the logits of the prompt's last token.
    The stages keep the prompt's blocks (for `export`) until their `end`; the transports are stopped."""
    inboxes = [StageInbox() for _ in stages]
    n = len(prompt_token_ids)
    sizes = [min(chunk_tokens, n - i) for i in range(0, n, chunk_tokens)]
    deadline = time.monotonic() + timeout_s
    try:
        addresses = [await t.start(inbox) for t, inbox in zip(transports, inboxes)]
        for stage in stages:
            stage.begin(request_id, prompt_token_ids)
        runs = [asyncio.ensure_future(run_stage(stage, k, request_id, sizes, _on_thread, inboxes[k], transports[k],
                                                addresses[k + 1] if k + 1 < len(stages) else None, deadline))
                for k, stage in enumerate(stages)]
        try:
            return (await asyncio.gather(*runs))[-1]
        finally:  # one stage failed: the others stop waiting for it
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
    finally:
        for transport in transports:
            await transport.stop()


async def _on_thread(stage, *args):
    return await asyncio.to_thread(stage.run, *args)
