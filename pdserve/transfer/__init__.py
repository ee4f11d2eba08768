"""KV page transfer between the page pools of two ranks (NIXL over UCX); see docs/transfer.md."""
