"""The conductor's scheduling policy: pure classes with an injected clock, shared by the live conductor
and the simulator. Views of the cluster in, a placement (or a rejection) out; no I/O."""
