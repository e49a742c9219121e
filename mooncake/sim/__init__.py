"""Trace-driven simulation: trace loading now; the discrete-event simulator joins later."""
