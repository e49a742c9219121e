"""Storage tiers for the KVCache store (the `mooncake.store.tier.StorageTier` contract)."""
