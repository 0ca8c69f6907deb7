"""What a verb says while it works: progress lines on stderr (``--quiet`` drops them, results and
warnings stay), and a heartbeat so a long stage is never silent (tracing a real model can take a
minute): plain lines, one every ``HEARTBEAT_S`` without other progress, readable in CI logs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import click

HEARTBEAT_S = 10.0


class Progress:
    def __init__(self) -> None:
        self.quiet = False
        self._last = time.perf_counter()

    def say(self, msg: str) -> None:
        """A progress line (dropped under ``--quiet``)."""
        self._last = time.perf_counter()
        if not self.quiet:
            click.echo(msg, err=True)

    def result(self, msg: str) -> None:
        """A result or warning line: always shown."""
        self._last = time.perf_counter()
        click.echo(msg, err=True)

    @contextlib.contextmanager
    def heartbeat(self, what: str, every: float = HEARTBEAT_S) -> Iterator[None]:
        """While the block runs, say ``… still {what} (Ns)`` after each ``every`` seconds without
        another progress line."""
        done = threading.Event()
        start = self._last = time.perf_counter()

        def beat() -> None:
            while not done.wait(max(0.01, self._last + every - time.perf_counter())):
                if time.perf_counter() - self._last >= every:
                    self.say(f"  … still {what} ({time.perf_counter() - start:.0f}s)")

        thread = threading.Thread(target=beat, name="aotpack-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()


PROGRESS = Progress()
