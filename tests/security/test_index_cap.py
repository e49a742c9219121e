"""No holder fills the global prefix index: an instance's reports count for at most as many blocks as its
KV cache holds (issue: cap what one holder may put into the global index)."""

import zmq

from mooncake import messages as m
from tests.api.test_api import Served


def test_an_instance_indexes_at_most_its_kv_blocks(tiny_dir):
    served = Served(**{"conductor.heartbeat_timeout_s": 600.0})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"prefill-greedy")
    sock.connect(served.control)
    try:
        sock.send(m.encode(m.Register(instance_id="prefill-greedy", role="prefill", num_kv_blocks=8,
                                      model_id=served.conductor.model.model_id, block_size=64, kv_dtype="float32")))
        assert sock.poll(10_000) and m.decode(sock.recv()).accepted
        index = served.conductor.index
        for seq, blocks in enumerate((range(6), range(100, 1_000_000)), start=1):
            sock.send(m.encode(m.Heartbeat(instance_id="prefill-greedy", seq=seq, cache=m.CacheChanges(added=list(blocks)))))
        sock.send(m.encode(m.Heartbeat(instance_id="prefill-greedy", seq=3, cache=m.CacheChanges(evicted=[0, 1]))))
        sock.send(m.encode(m.Heartbeat(instance_id="prefill-greedy", seq=4, cache=m.CacheChanges(added=[7, 8, 9]))))
        deadline = served.loop.time() + 10
        while served.loop.time() < deadline and not index.holders(8):  # the last report is in
            sock.poll(50)
        assert index.count("prefill-greedy") == 8 and len(index) == 8
        indexed = {h for h in (0, 1, 2, 3, 4, 5, 7, 8, 9, 100, 101, 102) if index.holders(h)}
        assert indexed == {2, 3, 4, 5, 100, 101, 7, 8}  # room freed by evictions is used again, never more
        # a full cache's steady state: a report evicts as many as it adds, and the new ones are indexed
        sock.send(m.encode(m.Heartbeat(instance_id="prefill-greedy", seq=5,
                                       cache=m.CacheChanges(added=[200, 201], evicted=[2, 3]))))
        while served.loop.time() < deadline + 10 and not index.holders(201):
            sock.poll(50)
        assert index.holders(200) and index.holders(201) and not index.holders(2)
        assert index.count("prefill-greedy") == 8
    finally:
        sock.close()
        served.close()
