"""Progress of a long data step (training a tokenizer, tokenizing a corpus): bytes done of total, MB/s, ETA.

On a terminal it is one line redrawn in place (carriage return); otherwise (a log file, CI) a plain line every
``interval`` seconds, so a redirected run still shows that it is alive. Written to stderr directly rather than
through ``logging``: the CLI configures no log handler, and this must be seen. Standard library only, so it can be
imported before the heavy modules.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_MB = 1e6


class Progress:
    """``update(done)`` with the bytes done so far; ``close()`` prints the last line. ``total`` may be None
    (a streamed HuggingFace dataset): then there is no percentage and no ETA. ``skipped`` bytes (work an
    earlier, interrupted run already did) count toward the total but not toward the speed."""

    def __init__(self, what: str, total: int | None, where: str, *, stream: TextIO | None = None,
                 interval: float | None = None, skipped: int = 0):
        self.what, self.total, self.where = what, total, where
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self.start = time.monotonic()
        self.skipped = skipped
        self.done = skipped
        self._last = 0.0
        self._write(f"{what}: {_size(total)} → {where}" + (f" (resuming: {_size(skipped)} done)" if skipped else ""),
                    final=True)

    def update(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._write(self.line(now), final=False)

    def close(self, summary: str = "") -> None:
        self._write(self.line(time.monotonic()) + (f"; {summary}" if summary else ""), final=True)

    def line(self, now: float) -> str:
        seconds = max(now - self.start, 1e-9)
        rate = (self.done - self.skipped) / seconds
        parts = [f"{self.what}: {self.done / _MB:,.1f}"]
        if self.total:
            fraction = min(self.done / self.total, 1.0)
            parts[0] += f" / {self.total / _MB:,.1f} MB ({100 * fraction:.0f}%)"
            if self.tty:
                filled = int(fraction * 24)
                parts.insert(0, "[" + "#" * filled + "." * (24 - filled) + "]")
        else:
            parts[0] += " MB"
        parts.append(f"{rate / _MB:.2f} MB/s")
        parts.append(f"{seconds:.0f}s")
        if self.total and rate > 0 and self.done < self.total:
            parts.append(f"ETA {_duration((self.total - self.done) / rate)}")
        return "  ".join(parts)

    def _write(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _size(n: int | None) -> str:
    return "size unknown" if n is None else f"{n / _MB:,.1f} MB"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
