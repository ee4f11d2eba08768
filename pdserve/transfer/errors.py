"""What a KV write can fail with, whatever moves the bytes (NIXL or the in-process backend)."""


class TransferError(RuntimeError):
    """A write failed: the peer died or disconnected, is unknown, or the transport reported an error."""


class TransferTimeout(TransferError):
    """A write did not complete within the caller's deadline; it was cancelled (released)."""
