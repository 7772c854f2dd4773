"""The node agent beside each GPU worker: registry lease, load, cache summary, drain (docs/AGENT.md).

Its Redis access (registry, prefix index) is `store`, shared with the gateway.
"""
