"""A local Redis Cluster from the embedded redis-server binary: N masters on loopback, no replicas.

Each node is an `EmbeddedRedis` started with `cluster-enabled yes` (so it keeps no files beyond its
own temporary directory and dies with its owner, as the single server does). The slots are split
evenly with CLUSTER ADDSLOTS, the nodes are joined with CLUSTER MEET, and `start()` returns once every
node reports `cluster_state:ok` and knows all the others: the same steps `redis-cli --cluster create`
takes, without a replica or a prompt. Tests and benchmarks use it (tests/conftest.py, bench/cluster_scale.py);
a client connects with `redis+cluster://host:port,...` (store/connect.py).

A node's cluster bus listens on its port + 10000 (Redis 6 has no `cluster-port`), so ports are picked
where both are free and outside the kernel's ephemeral range.
"""

from __future__ import annotations

import time

import redis

from store.redis_server import EmbeddedRedis, RedisServerError, free_port

SLOTS = 16384
BUS_OFFSET = 10000
# node ports 20000-22700, bus ports 30000-32700: both below Linux's ephemeral range (32768-60999)
_NODE_PORTS = (20000, 22700)
CLUSTER_ARGS = (
    "--cluster-enabled", "yes",
    "--cluster-config-file", "nodes.conf",  # in the node's own temporary --dir
    "--cluster-node-timeout", "5000",
)  # fmt: skip


def slot_ranges(masters: int) -> list[range]:
    """The 16384 hash slots split into `masters` contiguous, nearly equal ranges."""
    bounds = [SLOTS * i // masters for i in range(masters + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(masters)]


class EmbeddedRedisCluster:
    """`masters` private cluster-mode redis-servers joined into one cluster (a context manager)."""

    def __init__(self, masters: int = 3, binary: str | None = None, *, die_with_parent: bool = True) -> None:
        if masters < 1:
            raise ValueError(f"a cluster needs at least one master, not {masters}")
        self.nodes: list[EmbeddedRedis] = []
        for _ in range(masters):
            port = free_port((0, BUS_OFFSET), _NODE_PORTS)
            while any(abs(port - n.port) < 2 for n in self.nodes):
                port = free_port((0, BUS_OFFSET), _NODE_PORTS)
            self.nodes.append(
                EmbeddedRedis(port, binary, die_with_parent=die_with_parent, extra_args=CLUSTER_ARGS)
            )

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """`redis+cluster://` with every node as a startup node (any one of them would do)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 20.0) -> EmbeddedRedisCluster:
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start(timeout_s)
            clients = [redis.Redis(port=p, socket_timeout=5) for p in self.ports]
            try:
                for client, slots in zip(clients, slot_ranges(len(clients)), strict=True):
                    client.execute_command("CLUSTER", "ADDSLOTS", *slots)  # type: ignore[no-untyped-call]
                for port in self.ports[1:]:
                    clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)  # type: ignore[no-untyped-call]
                _wait_until_formed(clients, deadline)
            finally:
                for client in clients:
                    client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_until_formed(clients: list[redis.Redis], deadline: float) -> None:
    """Until every node sees the cluster as ok (all slots served) and knows every other node."""
    while True:
        infos = [_cluster_info(c) for c in clients]
        if all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == len(clients)
               for i in infos):  # fmt: skip
            return
        if time.monotonic() > deadline:
            raise RedisServerError(f"the cluster did not form in time: {infos}")
        time.sleep(0.05)


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    text = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)
