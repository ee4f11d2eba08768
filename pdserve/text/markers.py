"""Markers in streamed text (tool-call tokens, thinking tags): how much of a piece's end must wait for the next
piece, because it may be the start of one."""


def marker_prefix_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
