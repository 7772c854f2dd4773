"""Pure decision code shared by the gateway addon and the simulator.

Nothing in this package does I/O, touches asyncio or Redis, or reads a clock: time is a parameter
(`now_s`) and randomness comes from an injected `random.Random`.
"""
