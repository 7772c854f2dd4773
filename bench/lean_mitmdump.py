"""`mitmdump -s bench/lean_mitmdump.py`: bare mitmdump with the addon chain `kvgate proxy` runs.

`kvgate proxy` leaves mitmproxy's switched-off built-in addons out of the event chain
(plugin/lean_chain.py), which makes its mitmproxy part cheaper than a bare mitmdump's. `kvgate bench
overhead` measures this as a second reference, so the kvgate addon's own CPU per request is kvgate
minus this, not minus bare mitmdump (which would credit the addon with the leaner chain).
"""

from __future__ import annotations

from mitmproxy import ctx

from plugin.lean_chain import drop_idle_addons


class LeanChain:
    def running(self) -> None:
        drop_idle_addons(ctx.master.addons, ctx.options)


addons = [LeanChain()]
