from mooncake import messages as m
from mooncake.conductor.instances import InstanceRegistry


def reg(instance_id, role="decode"):
    return m.Register(instance_id=instance_id, role=role, model_id="x", block_size=16, kv_dtype="float32")


def test_silent_instances_die_and_must_register_again():
    r = InstanceRegistry(heartbeat_timeout_s=3.0)
    r.register(reg("d0"), now=0.0)
    r.register(reg("p0", "prefill"), now=0.0)
    assert r.heartbeat(m.Heartbeat(instance_id="d0", num_running=2), now=2.5) is not None
    assert r.expire(now=3.5) == [r.get("p0")]  # p0 silent 3.5 s, d0 only 1 s
    assert [i.instance_id for i in r.alive("decode")] == ["d0"] and r.alive("prefill") == []
    assert r.heartbeat(m.Heartbeat(instance_id="p0"), now=3.6) is None  # dead: register first
    assert r.heartbeat(m.Heartbeat(instance_id="nobody"), now=3.6) is None
    r.register(reg("p0", "prefill"), now=4.0)
    assert [i.instance_id for i in r.alive("prefill")] == ["p0"]


def test_an_instance_comes_back_without_its_old_requests():
    r = InstanceRegistry(heartbeat_timeout_s=1.0)
    r.register(reg("d0"), now=0.0).request_ids.add("a")
    r.leave("d0")
    assert r.alive("decode") == []
    assert r.register(reg("d0"), now=2.0).request_ids == set()
    # A process that restarted before its heartbeat timeout: the control plane declares the old one dead
    # first (conductor/control.py); the registry never carries requests over.
    r.get("d0").request_ids.add("b")
    assert r.register(reg("d0"), now=2.5).request_ids == set()
