"""A Decode sent again for a leg decoding here (a conductor that restarted adopts a leg whose HandOff its
API process sends again) changes nothing: the running stream goes on, nothing is reported failed. Once
the leg has ended here, its id may come again."""

import asyncio
from types import SimpleNamespace

from mooncake import messages as m
from mooncake.config import load_config
from mooncake.decode.worker import DecodeWorker
from mooncake.engine.engine import RequestOutput
from mooncake.errors import InvalidRequestError
from mooncake.sampling import WireSampling


class EngineOfIds:
    """The engine loop as far as admission goes: it refuses an id it holds, as the engine does."""

    def __init__(self):
        self.facts = SimpleNamespace(num_layers=2)
        self.held, self.entered = set(), []

    async def add_request(self, token_ids, params, request_id, keep_kv=False):
        if request_id in self.held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.held.add(request_id)
        self.entered.append(request_id)

    def pop_completion_now(self, request_id):
        self.held.discard(request_id)


class Reports:
    def __init__(self):
        self.reply_to, self.sent = {}, []

    def track(self, request_id, reply_to):
        self.reply_to[request_id] = reply_to

    def forget(self, request_id):
        self.reply_to.pop(request_id, None)

    async def send(self, request_id, msg):
        self.sent.append(msg)

    async def send_to(self, address, msg):
        self.sent.append(msg)


def decode(request_id: str) -> m.Decode:
    return m.Decode(request_id=request_id, token_ids=[5, 6, 7], block_hashes=[], sampling=WireSampling(max_tokens=4),
                    reply_to="tcp://127.0.0.1:9")


def test_a_decode_sent_again_for_a_running_leg_is_ignored_and_one_that_ended_may_come_again():
    async def main():
        worker = DecodeWorker(load_config(None))
        worker.loop, worker.reports = EngineOfIds(), Reports()
        for _ in range(2):
            await worker.on_message(decode("r1"))
            await asyncio.sleep(0.01)  # its admission runs
        assert worker.loop.entered == ["r1"]
        assert not [s for s in worker.reports.sent if isinstance(s, m.RequestFailed)]
        assert worker.reports.reply_to == {"r1": "tcp://127.0.0.1:9"}  # its tokens still go to its API process
        await worker.on_outputs([RequestOutput("r1", [9], True, "length", 3, 0)])
        await worker.on_message(decode("r1"))  # ended here: the id is free again
        await asyncio.sleep(0.01)
        assert worker.loop.entered == ["r1", "r1"]

    asyncio.run(main())
