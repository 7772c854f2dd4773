"""Preble's global radix tree of routed prompts (H), the prefix state behind bench/peers/preble.py.

Sources: see bench/peers/preble.py (`WukLab/preble: multi_node/global_scheduler_with_time.py`,
commit 0c962c4c).

The tree is over trace blocks weighted in tokens (a token radix tree where distinct block ids differ in
their first token). Per node: `num_tokens` (its segment), `context_length` (tokens from the root through
the node), its GPU allocation, and per GPU the running requests whose prompt passes through it. A node is
*large* (important) when `num_tokens > context_length - num_tokens`; a request's important node is the
nearest large ancestor of its leaf, and carries the `Stats` of its 3-minute window. Subtree moves are
lazy: a moved node records the move and descendants pick it up when a route walks their path
(`materialize_path`); each node indexes the windowed stats of its subtree so a move can update those
at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.sim.types import SimRequest


@dataclass(eq=False, slots=True)
class Stats:
    """Windowed history of one important node (moves with it when a split renames it)."""

    node: Node
    count: int = 0
    hist_tokens: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    decode_size: int = 0  # max_tokens of the latest request, until outputs are known
    out_sum: int = 0
    out_n: int = 0
    in_window: bool = False
    c_prefill: dict[str, float] = field(default_factory=dict)  # contributions added to the GPU sums
    c_min2: bool = False
    c_decode: dict[str, float] = field(default_factory=dict)
    ttft: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    t_key: tuple[int, int] = (-1, -1)  # (num_tokens, context before) of the cached prefill time
    t_prefill: float = 0.0

    def out_len(self) -> float:
        return self.out_sum / self.out_n if self.out_n else float(self.decode_size)


@dataclass(eq=False, slots=True)
class Node:
    """One segment of the radix tree: its blocks, token counts, allocation and running references."""

    parent: Node | None
    blocks: list[int]
    num_tokens: int
    context_length: int
    children: dict[int, Node] = field(default_factory=dict)
    alloc: set[str] = field(default_factory=set)
    alloc_seq: int = 0  # when `alloc` was last set on this node itself
    move_seq: int = 0  # when this subtree was last moved whole to `move_gpu` (lazy update_children)
    move_gpu: str = ""
    stats: Stats | None = None
    windowed: set[Stats] = field(default_factory=set)  # windowed stats in this subtree, itself included
    ref: dict[str, int] = field(default_factory=dict)  # gpu -> running requests whose prompt passes here

    def is_large(self) -> bool:
        return self.num_tokens > self.context_length - self.num_tokens


class PrefixTree:
    """The radix tree with its block index; `on_reshape(stats)` is told when a split changes a node whose
    stats feed the cost sums (the owner refreshes that node's contribution)."""

    def __init__(self, on_reshape: Callable[[Stats], None]) -> None:
        self.root = Node(None, [], 0, 0)
        self.where: dict[int, Node] = {}  # block id -> node whose segment holds it
        self._tokens: dict[int, int] = {}  # block id -> tokens
        self._on_reshape = on_reshape

    def split(self, node: Node, keep: int) -> Node:
        """Split `node` after its first `keep` blocks; the new parent takes them (upstream: split_nodes)."""
        assert node.parent is not None
        head = node.blocks[:keep]
        head_tokens = sum(self._tokens[b] for b in head)
        parent = Node(node.parent, head, head_tokens, node.context_length - node.num_tokens + head_tokens)
        parent.alloc, parent.alloc_seq = set(node.alloc), node.alloc_seq
        parent.windowed = set(node.windowed)
        parent.ref = dict(node.ref)  # every request through the node also passes its new parent
        node.parent.children[head[0]] = parent
        node.blocks = node.blocks[keep:]
        node.num_tokens -= head_tokens
        node.parent = parent
        parent.children[node.blocks[0]] = node
        for b in head:
            self.where[b] = parent
        stats = node.stats
        if stats is not None and parent.is_large() and not node.is_large():  # upstream rename_node
            node.stats, parent.stats, stats.node = None, stats, parent
            node.windowed.discard(stats)
        if stats is not None:
            self._on_reshape(stats)
        return parent

    def insert(self, req: SimRequest) -> Node:
        """Insert the request's blocks; return the node where its prompt ends (its leaf)."""
        ids, toks = req.block_ids, req.block_tokens
        for b, t in zip(ids, toks, strict=True):
            self._tokens.setdefault(b, t)
        m = 0
        while m < len(ids) and ids[m] in self.where:
            m += 1
        if m == 0:
            at = self.root
        else:
            at = self.where[ids[m - 1]]
            keep = at.blocks.index(ids[m - 1]) + 1
            if keep < len(at.blocks):
                at = self.split(at, keep)
        if m == len(ids):
            return at
        rest = list(ids[m:])
        n = sum(toks[m:])
        leaf = Node(at, rest, n, at.context_length + n)
        at.children[rest[0]] = leaf
        for b in rest:
            self.where[b] = leaf
        return leaf

    def materialize_path(self, leaf: Node) -> list[Node]:
        """Top-level node .. leaf, each with its allocation brought up to date with subtree moves above it."""
        path: list[Node] = []
        node: Node | None = leaf
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        path.reverse()
        move_seq, move_gpu = 0, ""
        for n in path:
            if n.move_seq > move_seq:
                move_seq, move_gpu = n.move_seq, n.move_gpu
            if move_seq > n.alloc_seq:
                n.alloc, n.alloc_seq = {move_gpu}, move_seq
        return path

    def set_windowed(self, s: Stats, on: bool) -> None:
        """Enter or leave the window, keeping every ancestor's index of windowed descendants."""
        if s.in_window == on:
            return
        s.in_window = on
        node: Node | None = s.node
        while node is not None and node is not self.root:
            if on:
                node.windowed.add(s)
            else:
                node.windowed.discard(s)
            node = node.parent

    def important(self, node: Node) -> tuple[Stats, int]:
        """The nearest large ancestor's stats (top-level nodes are always large) and its distance."""
        imp, hops = node, 0
        while imp.parent is not None and imp.parent is not self.root and not imp.is_large():
            imp, hops = imp.parent, hops + 1
        if imp.stats is None:
            imp.stats = Stats(imp)
        return imp.stats, hops

    def allocation_of(self, block_ids: Sequence[int]) -> set[str]:
        """The allocation of the node holding the last of `block_ids` (empty if unknown)."""
        node = self.where.get(block_ids[-1])
        return set(node.alloc) if node is not None else set()


def node_key(node: Node) -> tuple[int, int]:
    """A stable tie-break for nodes of equal cost: where the node starts in the tree (its first block
    id names its whole prefix). Object ids would make runs differ from process to process."""
    return (node.context_length - node.num_tokens, node.blocks[0] if node.blocks else -1)
