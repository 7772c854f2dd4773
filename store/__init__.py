"""The Redis layer the gateway and the node agent share: key names, the worker registry, the prefix
index, the admission scripts and slot pool, the Lua loader, the RESP fast path and the embedded server.

asyncio and redis-py only: nothing here imports mitmproxy, `plugin` or `agent` (docs/ARCHITECTURE.md).
"""
