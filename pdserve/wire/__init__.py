"""What crosses a process boundary: the internal API's messages and its client, sampling parameters, KV events and
block hashes. No torch: the router imports this package."""
