"""Model runners (the `mooncake.engine.runner.ModelRunner` contract)."""
