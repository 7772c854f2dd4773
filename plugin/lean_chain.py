"""Take mitmproxy's built-in addons that a gateway leaves switched off out of the event chain.

mitmproxy dispatches every event (request, response, each connection event, ...) by walking its
whole addon chain, about 35 addons in mitmdump, looking each hook up on each addon: that walk is
about half of a bare mitmdump's CPU per request (MITMPROXY.md §3). Most of those addons do nothing
unless an option turns them on (map_remote, modify_headers, stickycookie, save_stream_file, ...)
or only serve interactive tools (commands of the console and web UIs, which `kvgate proxy` has not).
`drop_idle_addons` removes those whose options are at their off values when the gateway starts, so
behaviour is unchanged: set one of the options (after `--` on the `kvgate proxy` command line) and
that addon stays. Their options stay registered, so `--set` of them keeps parsing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Options = Any  # mitmproxy.options.Options (its attributes are the registered options)

# addon name (mitmproxy's lookup name) -> True when the addon has nothing to do with these options
IDLE_WHEN: dict[str, Callable[[Options], bool]] = {
    # commands for the interactive UIs only
    "browser": lambda o: True,
    "commandhistory": lambda o: True,
    "comment": lambda o: True,
    "cut": lambda o: True,
    "export": lambda o: True,
    # DNS-mode only
    "stripdnshttpsrecords": lambda o: o.mode is not None and all("dns" not in m for m in o.mode),
    # off unless their option is set
    "block": lambda o: not o.block_global and not o.block_private,
    "blocklist": lambda o: not o.block_list,
    "anticache": lambda o: not o.anticache,
    "anticomp": lambda o: not o.anticomp,
    "clientplayback": lambda o: not o.client_replay,
    "serverplayback": lambda o: not o.server_replay,
    "onboarding": lambda o: not o.onboarding,
    "proxyauth": lambda o: not o.proxyauth,
    "mapremote": lambda o: not o.map_remote,
    "maplocal": lambda o: not o.map_local,
    "modifybody": lambda o: not o.modify_body,
    "modifyheaders": lambda o: not o.modify_headers,
    "stickyauth": lambda o: not o.stickyauth,
    "stickycookie": lambda o: not o.stickycookie,
    "save": lambda o: not o.save_stream_file,
    "savehar": lambda o: not o.hardump,
    "upstreamauth": lambda o: not o.upstream_auth,
    "dumper": lambda o: o.flow_detail == 0,  # prints nothing at flow_detail 0
}


def idle_addons(addons: Any, options: Options) -> list[Any]:
    """The chain's addons that `IDLE_WHEN` says have nothing to do under `options`."""
    out = []
    for name, idle in IDLE_WHEN.items():
        addon = addons.get(name)
        if addon is None or addon not in addons.chain:
            continue
        try:
            if idle(options):
                out.append(addon)
        except AttributeError:  # an option this mitmproxy version does not have: leave the addon
            continue
    return out


def drop_idle_addons(addons: Any, options: Options) -> list[str]:
    """Remove the idle addons from mitmproxy's chain (before `running`); returns their names."""
    dropped = idle_addons(addons, options)
    # AddonManager.remove() would run their `done` hook, which for some is async; nothing of theirs
    # has started yet (this runs before `running`), so they only leave the chain and the lookup.
    names = []
    for addon in dropped:
        for name, found in list(addons.lookup.items()):
            if found is addon:
                del addons.lookup[name]
                names.append(name)
        addons.chain = [a for a in addons.chain if a is not addon]
    if names:
        logger.debug("kvgate: mitmproxy addons left out of the event chain: %s", ", ".join(names))
    return names
