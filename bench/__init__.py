"""Simulator, emulated workers, load generator and benchmarks (`kvgate bench ...`)."""
