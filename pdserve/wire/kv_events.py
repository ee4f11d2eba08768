"""Events a rank's prefix cache emits as pages enter and leave it; the router's prefix index is built from them."""

from dataclasses import dataclass, field
from typing import Literal

KVEventKind = Literal["stored", "removed", "cleared"]


@dataclass
class KVEvent:
    """`block_hashes` are chained hashes of full pages of token ids (pdserve.wire.block_hash);
    a `stored` event also carries the hash of the page before its first block (ROOT_HASH at the start)."""

    kind: KVEventKind
    block_hashes: list[int] = field(default_factory=list)
    parent_hash: int | None = None
