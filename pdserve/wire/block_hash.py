"""Stable chained hashes of full pages of token ids: the keys the prefix cache reports and the router matches."""

import hashlib
from collections.abc import Iterator

import numpy as np

ROOT_HASH = 0


def page_hash(parent_hash: int, page_token_ids: list[int]) -> int:
    """Hash of one full page given the hash of everything before it (stable across processes and runs)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent_hash.to_bytes(8, "little", signed=False))
    digest.update(np.asarray(page_token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little", signed=False) & ((1 << 63) - 1)


def iter_prefix_page_hashes(token_ids: list[int], page_size: int) -> Iterator[int]:
    """The chained hash of every full page of `token_ids`, in order, each made when asked for (a lookup that stops
    at the first page nobody holds hashes no further)."""
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size])
        yield parent


def prefix_page_hashes(token_ids: list[int], page_size: int) -> list[int]:
    """The chained hash of every full page of `token_ids`, in order."""
    return list(iter_prefix_page_hashes(token_ids, page_size))
