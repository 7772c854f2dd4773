"""`kvgate proxy`'s master leaves the built-in addons its options did not switch on out of the event chain."""

from __future__ import annotations

import pytest
from mitmproxy import options

from plugin.launcher import KvGateMaster
from plugin.lean_chain import IDLE_WHEN, drop_idle_addons

ESSENTIAL = ("core", "proxyserver", "nextlayer", "tlsconfig", "scriptloader", "errorcheck", "kvgate")


async def master_with(**opts: object) -> KvGateMaster:
    master = KvGateMaster(options.Options())
    master.options.update(**opts)
    return master


async def test_defaults_drop_the_idle_addons_and_keep_the_proxy() -> None:
    master = await master_with()
    before = len(master.addons.chain)
    dropped = drop_idle_addons(master.addons, master.options)
    assert {"dumper", "onboarding", "modifyheaders", "mapremote", "save", "browser"} <= set(dropped)
    assert set(dropped) <= set(IDLE_WHEN)
    assert len(master.addons.chain) == before - len(dropped)
    for name in ESSENTIAL:
        addon = master.addons.get(name)
        assert addon is not None and addon in master.addons.chain, name
    for name in dropped:
        assert master.addons.get(name) is None
    assert master.options.modify_headers == []  # the options stay registered


@pytest.mark.parametrize(
    ("option", "value", "addon"),
    [
        ("modify_headers", ["/~q/x-a/b"], "modifyheaders"),
        ("map_remote", ["|example.com|example.org"], "mapremote"),
        ("anticache", True, "anticache"),
        ("stickycookie", ".*", "stickycookie"),
        ("flow_detail", 1, "dumper"),
        ("onboarding", True, "onboarding"),
        ("block_private", True, "block"),
    ],
    ids=["modify-headers", "map-remote", "anticache", "stickycookie", "flow-detail", "onboarding", "block"],
)
async def test_an_addon_switched_on_stays(option: str, value: object, addon: str) -> None:
    master = await master_with(**{option: value})
    dropped = drop_idle_addons(master.addons, master.options)
    assert addon not in dropped
    assert master.addons.get(addon) in master.addons.chain
