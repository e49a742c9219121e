"""The conductor's instance registry: who registered, their last heartbeat and load; an instance silent
past the heartbeat timeout is dead and gets no more work. Pure bookkeeping with an injected clock."""

from dataclasses import dataclass, field

from mooncake import messages as m


@dataclass
class Instance:
    instance_id: str
    role: str
    transport: str
    data_address: str
    num_kv_blocks: int
    last_seen_s: float
    load: m.Heartbeat | None = None
    is_alive: bool = True
    last_seq: int = 0  # of its last heartbeat
    request_ids: set[str] = field(default_factory=set)  # in flight here
    last_done_s: float = 0.0  # prefill: when it last handed a request off (it works on the rest since)
    step_s: float = 0.0  # decode: its steps' mean time in its last heartbeat that reported steps (0: none yet)


class InstanceRegistry:
    def __init__(self, heartbeat_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.instances: dict[str, Instance] = {}

    def register(self, msg: m.Register, now: float) -> Instance:
        """Add (or re-add after a restart) an instance; requests it had before are not its any more."""
        instance = Instance(msg.instance_id, msg.role, msg.transport, msg.data_address, msg.num_kv_blocks, now)
        self.instances[msg.instance_id] = instance
        return instance

    def heartbeat(self, msg: m.Heartbeat, now: float) -> Instance | None:
        """Record a heartbeat; None if the sender is unknown or was declared dead (it must register)."""
        instance = self.instances.get(msg.instance_id)
        if instance is None or not instance.is_alive:
            return None
        instance.last_seen_s = now
        instance.load = msg
        if msg.step_samples:
            instance.step_s = sum(sample.seconds for sample in msg.step_samples) / len(msg.step_samples)
        return instance

    def expire(self, now: float) -> list[Instance]:
        """Mark instances silent for longer than the timeout dead; returns the newly dead."""
        dead = []
        for instance in self.instances.values():
            if instance.is_alive and now - instance.last_seen_s > self.heartbeat_timeout_s:
                instance.is_alive = False
                dead.append(instance)
        return dead

    def leave(self, instance_id: str) -> None:
        """A clean departure: dead from now on, as if its heartbeats had stopped."""
        self.instances[instance_id].is_alive = False

    def alive(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.is_alive and i.role == role]

    def get(self, instance_id: str) -> Instance | None:
        return self.instances.get(instance_id)
