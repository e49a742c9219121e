"""What the prefill and decode roles share: the engine's step loop on its own thread, and the link to the
conductor (register, heartbeat, messages both ways)."""
