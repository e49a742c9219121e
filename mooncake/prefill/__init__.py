"""The prefill role: computes a prompt's KV and its first token, and hands the KV to decode and the pool."""
