"""The decode role: takes prefilled requests (KV from prefill) into continuous batching, streams tokens."""
