"""In-process transport for tests: endpoints meet in a module-level registry; bytes are copied and
checksummed exactly as on a wire, so the contract suite exercises the same verification."""

import time

from mooncake.transfer.contract import BlockResult, BlockService, TransferError, TransferResult, Transport, \
    new_request_id
from mooncake.transfer.framing import Tamper, block_frames, self_checked_sums, verify_blocks

_ENDPOINTS: dict[str, "InprocTransport"] = {}
_counter = iter(range(1, 1 << 62))


class InprocTransport(Transport):
    name = "inproc"

    @classmethod
    def from_config(cls, config, host):
        return cls()  # one process: no address to listen on

    def __init__(self, tamper: Tamper = None):
        self.tamper = tamper
        self.service: BlockService | None = None
        self.address: str | None = None

    async def start(self, service=None, address=None) -> str:
        self.service = service
        self.address = address or f"inproc://endpoint-{next(_counter)}"
        if service is not None:
            _ENDPOINTS[self.address] = self
        return self.address

    def _peer(self, peer: str, request_id: str) -> "InprocTransport":
        endpoint = _ENDPOINTS.get(peer)
        if endpoint is None or endpoint.service is None:
            raise TransferError(f"transfer {request_id}: peer {peer} is not serving")
        return endpoint

    async def send(self, peer, blocks, timeout_s, request_id=None, self_checked=False) -> TransferResult:
        request_id = request_id or new_request_id()
        start = time.perf_counter()
        endpoint = self._peer(peer, request_id)
        keys, sizes, sums, frames = block_frames(blocks, self.tamper, self_checked_sums(blocks, self_checked))
        results = []
        for block, digest in zip(verify_blocks(keys, sums, [bytes(f) for f in frames]), sums):
            if block.ok:
                block = BlockResult(block.key, error=endpoint.service.put_block(block.key, block.data, digest))
            results.append(BlockResult(block.key, error=block.error))
        return TransferResult(peer, request_id, results, sum(sizes), time.perf_counter() - start)

    async def fetch(self, peer, keys, timeout_s, request_id=None) -> TransferResult:
        request_id = request_id or new_request_id()
        start = time.perf_counter()
        endpoint = self._peer(peer, request_id)
        service = endpoint.service
        if service.locates_blocks:  # the checksum it kept (or a payload's bound digest) instead of a fresh hash
            located = [(k, loc) for k in keys if (loc := service.locate_block(k)) is not None]
            found, known = [(k, loc.data) for k, loc in located], [loc.checksum for _, loc in located]
        else:
            found, known = [(k, d) for k in keys if (d := service.get_block(k)) is not None], None
        _, sizes, sums, frames = block_frames(found, endpoint.tamper, known)
        by_key = {k: (s, bytes(f)) for (k, _), s, f in zip(found, sums, frames)}
        results = verify_blocks(keys, [by_key.get(k, (None, b""))[0] for k in keys],
                                [by_key.get(k, (None, b""))[1] for k in keys])
        return TransferResult(peer, request_id, results, sum(sizes), time.perf_counter() - start)

    async def stop(self) -> None:
        if self.address and _ENDPOINTS.get(self.address) is self:
            del _ENDPOINTS[self.address]
        self.service = None
