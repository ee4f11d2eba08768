"""The blob a rank hands to peers so they can write into its pool: NIXL agent metadata plus the pool layout.

Encoded with msgspec (msgpack), never pickled. Versioned so that a peer running other code fails loudly.
"""

import msgspec

from pdserve.transfer.layout import PoolLayout

METADATA_VERSION = 2  # 2: page-major pools (a peer of version 1 would address its pages layer-major)


class AgentMetadata(msgspec.Struct, frozen=True):
    version: int
    agent_name: str
    nixl_metadata: bytes  # nixl_agent.get_agent_metadata(): connection info and registered memory
    layout: PoolLayout


def encode_metadata(metadata: AgentMetadata) -> bytes:
    return msgspec.msgpack.encode(metadata)


def decode_metadata(blob: bytes) -> AgentMetadata:
    metadata = msgspec.msgpack.decode(blob, type=AgentMetadata)
    if metadata.version != METADATA_VERSION:
        raise ValueError(f"transfer metadata version {METADATA_VERSION} expected, got {metadata.version}")
    return metadata
