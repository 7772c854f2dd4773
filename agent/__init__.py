"""The node agent beside each GPU worker: registry lease, load, cache summary, drain (docs/AGENT.md).

`agent.registry` and `agent.index_store` are also the gateway's Redis access to the worker registry and
the shared prefix index.
"""
