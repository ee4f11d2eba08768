"""Tokenization, chat templating and grammar checks on a few threads, so that a huge prompt never stalls the event
loop that streams every other request's tokens. Threads suffice: `tokenizers` drops the GIL while it encodes a
batch (the bulk of the work), and a template's Jinja rendering of even a 4 MiB message is milliseconds.

A short text is done on the loop instead: tokenizing 1 KiB takes ~0.1 ms, less than handing it to a thread, where
under load the result then waits for the GIL behind the loop (up to its 5 ms switch interval)."""

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import TypeVar

from pdserve.text.tokenizer import SHORT_TEXT_CHARS

T = TypeVar("T")


class TextWorkers:
    def __init__(self, threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="router-text")
        self.jobs_started = 0  # how many jobs ran, here or on the threads (tests: a refused prompt starts none)

    async def run(self, chars: float, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs), for a job over `chars` characters of text (math.inf: always on a thread)."""
        self.jobs_started += 1
        if chars <= SHORT_TEXT_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
