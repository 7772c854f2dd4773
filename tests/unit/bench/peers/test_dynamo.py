"""Dynamo KV router: argmin of overlap_weight * prefill blocks + decode blocks, R accounting."""

from __future__ import annotations

import random

import pytest

from bench.peers.dynamo import DynamoRouter, make_router
from tests.unit.bench.peers.fake_cluster import FakeCluster, request

WORKERS = ["w0", "w1"]


def test_config_rejects_negative_weight() -> None:
    with pytest.raises(ValueError, match="overlap_score_weight"):
        DynamoRouter(random.Random(0), overlap_score_weight=-1)


def test_overlap_lowers_the_cost_and_wins_on_an_idle_cluster() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS, engine_blocks={"w1": {1, 2}})
    # 4 x 512 tokens: w0 prefill 32 + decode 32 = 64 ; w1 prefill 16 + decode 32 = 48
    assert router.route(request([1, 2, 3, 4]), cluster, 0.0) == "w1"
    assert router.last_logits == {"w0": 64.0, "w1": 48.0}


def test_active_prefill_and_decode_blocks_push_load_elsewhere() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS, engine_blocks={"w1": {1, 2}})
    router.route(request([1, 2, 3, 4], rid=1), cluster, 0.0)  # w1: +16 prefill blocks (1024 tok), +32 decode
    # same prompt again: w0 = 32 + 32 = 64 ; w1 = (1024 + 1024)/64 + 32 (shared blocks counted once) = 64
    router.route(request([1, 2, 3, 4], rid=2), cluster, 0.0)
    assert router.last_logits == {"w0": 64.0, "w1": 64.0}


def test_first_token_releases_prefill_and_finish_releases_blocks() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS)
    req = request([1, 2], rid=7)
    chosen = router.route(req, cluster, 0.0)
    assert router.active_prefill_tokens[chosen] == 1024 and router.active_blocks[chosen] == 16
    router.on_first_token(req, chosen, 1.0)
    assert router.active_prefill_tokens[chosen] == 0 and router.active_blocks[chosen] == 16
    router.on_finish(req, chosen, 2.0)
    assert router.active_blocks[chosen] == 0


def test_decode_blocks_dominate_when_prefill_is_cached_everywhere() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS, engine_blocks={"w0": {1, 9}, "w1": {1, 9}})
    router.route(request([9], rid=1, last_tokens=512), cluster, 0.0)
    busy = next(w for w, n in router.active_blocks.items() if n)
    router.on_first_token(request([9], rid=1), busy, 0.5)
    # prompt [1]: fully cached on both, so the worker without active decode blocks wins
    assert router.route(request([1], rid=2), cluster, 1.0) != busy


def test_partial_last_block_counts_as_its_own_block() -> None:
    router = make_router(0)
    cluster = FakeCluster(WORKERS, engine_blocks={"w1": {1, 2}})
    # 512 + 100 tokens, w1 caches both trace blocks but only 9 full 64-token blocks (576 tokens):
    # w1 prefill (612 - 576)/64 = 0.5625 + decode 8 + 2 = 10.5625 ; w0 612/64 = 9.5625 + 10
    router.route(request([1, 2], last_tokens=100), cluster, 0.0)
    assert router.last_logits == {"w0": 19.5625, "w1": 10.5625}
