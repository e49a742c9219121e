"""Moving KV block bytes between processes: the transport contract and its shared wire framing."""

from mooncake.transfer.contract import BlockResult, BlockService, TransferResult, Transport

__all__ = ["BlockResult", "BlockService", "TransferResult", "Transport"]
