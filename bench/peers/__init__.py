"""Peer routers re-implemented for the simulator, each citing its source (shared/reference/PEERS.md)."""
