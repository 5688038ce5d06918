"""A compressed trie over token-id keys, packed as int32 bytes on its edges.

Shared by the prefix cache (RAM) and its disk tier's index. A lookup is one
walk over the prompt (C-speed `bytes.startswith` per edge) and a 30k-token key
costs 120 KB, shared with every key it has a common prefix with. Nodes hold an
opaque `entry`; a node that holds one keeps its identity while the trie is
split and pruned around it.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TOKEN_BYTES", "Node", "Trie", "pack", "unpack"]

TOKEN_BYTES = 4  # bytes per token id in a packed key
assert array("i").itemsize == TOKEN_BYTES


class Node:
    """A trie node; `label` is the packed key bytes on the edge from its parent."""

    __slots__ = ("children", "entry", "label", "parent")

    def __init__(self, label: bytes, parent: Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.entry: Any = None


def pack(ids: Sequence[int]) -> bytes:
    try:
        return array("i", ids).tobytes()
    except OverflowError as e:
        raise ValueError("token ids must fit in a signed 32-bit integer") from e


def unpack(key: bytes) -> list[int]:
    return array("i", key).tolist()


def _common_bytes(label: bytes, key: bytes, pos: int) -> int:
    """Bytes (whole tokens) that `label` shares with `key[pos:]`; the first token matches."""
    most = min(len(label), len(key) - pos) // TOKEN_BYTES
    view = memoryview(label)
    if key.startswith(view[: most * TOKEN_BYTES], pos):
        return most * TOKEN_BYTES
    lo, hi = 1, most - 1  # lo tokens match; more than hi do not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key.startswith(view[: mid * TOKEN_BYTES], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo * TOKEN_BYTES


class Trie:
    """Compressed trie over packed keys. Nodes holding entries keep their identity."""

    def __init__(self) -> None:
        self.root = Node(b"", None)

    def longest_strict_prefix(
        self, key: bytes, accept: Callable[[Any], bool] | None = None
    ) -> Node | None:
        """The deepest node with an entry (one `accept` takes, if given) whose key is a
        strict prefix of `key`."""
        best = None
        for node in self.path_nodes(key[:-TOKEN_BYTES]):
            if node.entry is not None and (accept is None or accept(node.entry)):
                best = node
        return best

    def path_nodes(self, key: bytes) -> list[Node]:
        """The nodes whose keys are prefixes of `key` (`key` itself included), shallowest first."""
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child = node.children.get(key[pos : pos + TOKEN_BYTES])
            if child is None or pos + len(child.label) > len(key):
                break
            if not key.startswith(child.label, pos):
                break
            node, pos = child, pos + len(child.label)
            path.append(node)
        return path

    @staticmethod
    def key_of(node: Node) -> bytes:
        """The packed key a node stands for (its edge labels from the root)."""
        labels = []
        current: Node | None = node
        while current is not None:
            labels.append(current.label)
            current = current.parent
        return b"".join(reversed(labels))

    def shared_bytes(self, key: bytes) -> int:
        """How many leading bytes of `key` lie on the trie (shared with some stored key)."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + TOKEN_BYTES])
            if child is None:
                break
            common = _common_bytes(child.label, key, pos)
            pos += common
            if common < len(child.label):
                break
            node = child
        return pos

    def best_reuse(
        self, key: bytes, accept: Callable[[Any], bool] | None = None
    ) -> tuple[Node | None, int]:
        """The entry that reuses most of `key`, and how many tokens of it.

        Normally the longest entry whose key is a strict prefix. A trimmable
        entry (its `trimmable` attribute) that shares more of `key` than that,
        e.g. a `prompt + output` entry whose reply was re-rendered differently,
        reuses the shared part instead (trimmed back to it, rounded down to a
        multiple of its `trim_step` where it has one). Entries need `key_len`
        and `trimmable`; `accept` filters them.
        """
        node = self.longest_strict_prefix(key, accept)
        best = 0 if node is None else node.entry.key_len
        tokens = len(key) // TOKEN_BYTES
        usable = min(self.shared_bytes(key) // TOKEN_BYTES, tokens - 1)
        if usable > best:
            below = self.trimmable_node_below(key[: usable * TOKEN_BYTES], accept)
            if below is not None and _trimmed_reuse(below.entry, usable) > best:
                node = below
        if node is None:
            return None, 0
        entry = node.entry
        return node, _trimmed_reuse(entry, usable) if entry.trimmable else entry.key_len

    def trimmable_node_below(
        self, key: bytes, accept: Callable[[Any], bool] | None = None
    ) -> Node | None:
        """A node holding a trimmable entry (that `accept` takes) whose key starts with `key`."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + TOKEN_BYTES])
            if child is None:
                return None
            common = _common_bytes(child.label, key, pos)
            if common < len(child.label) and pos + common < len(key):
                return None
            node, pos = child, pos + len(child.label)
        stack = [node]
        while stack:
            current = stack.pop()
            entry = current.entry
            if entry is not None and entry.trimmable and (accept is None or accept(entry)):
                return current
            stack.extend(current.children.values())
        return None

    def node_for(self, key: bytes) -> tuple[Node, list[Node]]:
        """Find or make the node for `key`; also the entry nodes on strict prefixes."""
        node, pos = self.root, 0
        prefixes: list[Node] = []
        while pos < len(key):
            head = key[pos : pos + TOKEN_BYTES]
            child = node.children.get(head)
            if child is None:
                leaf = Node(key[pos:], node)
                node.children[head] = leaf
                return leaf, prefixes
            common = _common_bytes(child.label, key, pos)
            if common < len(child.label):
                child = self._split(child, common)
            node, pos = child, pos + common
            if pos < len(key) and node.entry is not None:
                prefixes.append(node)
        return node, prefixes

    @staticmethod
    def _split(node: Node, at: int) -> Node:
        """Put a new node `at` bytes down `node`'s edge; `node` keeps its identity."""
        parent = node.parent
        assert parent is not None
        mid = Node(node.label[:at], parent)
        parent.children[node.label[:TOKEN_BYTES]] = mid
        node.label = node.label[at:]
        node.parent = mid
        mid.children[node.label[:TOKEN_BYTES]] = node
        return mid

    def remove(self, node: Node) -> None:
        """Drop `node`'s entry and prune nodes that no longer branch or hold one."""
        node.entry = None
        while node is not self.root and node.entry is None:
            parent = node.parent
            assert parent is not None
            head = node.label[:TOKEN_BYTES]
            if not node.children:
                del parent.children[head]
                node = parent
                continue
            if len(node.children) == 1:
                (only,) = node.children.values()
                only.label = node.label + only.label
                only.parent = parent
                parent.children[head] = only
            break


def _trimmed_reuse(entry: Any, usable: int) -> int:
    """Tokens a trimmable entry gives a key sharing `usable` tokens with it."""
    if entry.key_len <= usable:
        return int(entry.key_len)
    step = int(getattr(entry, "trim_step", 1))
    return usable // step * step
