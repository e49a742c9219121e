"""The OpenAI-compatible HTTP endpoint the conductor serves (aiohttp): request schemas, SSE, routes."""
