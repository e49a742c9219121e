"""Transports (the `mooncake.transfer.contract.Transport` contract)."""
