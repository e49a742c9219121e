"""Pluggable implementations behind mooncake's contracts, found by name through `mooncake.registry`."""
