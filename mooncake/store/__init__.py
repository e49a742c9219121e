"""The KVCache store (cache role): DRAM and SSD tiers of prefix-keyed blocks, eviction, leases."""
