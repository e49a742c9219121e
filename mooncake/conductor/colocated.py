"""The colocated baseline's placement (conductor.mode = "colocated"): no prefill role; each request goes
whole to one instance, which prefills it in chunks beside the requests it decodes (continuous batching
under a token budget, with its local prefix cache), as vLLM does. The instance is the decode role given a
request with no KV; the conductor picks the one with the fewest requests in flight, admits everything
(vLLM has no early rejection) and streams and migrates as it does for Mooncake."""

from mooncake.conductor.flight import Flight
from mooncake.conductor.instances import InstanceRegistry
from mooncake.conductor.view import Placement
from mooncake.errors import Unavailable


def place_colocated(registry: InstanceRegistry, flights: dict[str, Flight], avoid: tuple[str, ...] = ()) -> Placement:
    """The least-loaded live instance (ties by id), leaving out those in `avoid` while another is alive."""
    instances = registry.alive("decode")
    instances = [i for i in instances if i.instance_id not in avoid] or instances
    if not instances:
        raise Unavailable("no live instance to serve the request; retry when one has registered")
    chosen = min(instances, key=lambda i: (sum(r in flights for r in i.request_ids), i.instance_id))
    return Placement(prefill_id="", decode_id=chosen.instance_id, reuse_blocks=0, fetch_from=None, ttft_s=0.0,
                     tbt_s=0.0)
