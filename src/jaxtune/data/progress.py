"""Progress of a long step before training (training a tokenizer, tokenizing a corpus: bytes done of total, MB/s,
ETA; the reference log-probs of preference pairs, the step-0 evaluation: a count of ``unit``).

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
    """``update(done)`` with the work done so far (bytes, or ``unit``s); ``close()`` prints the last line. ``total``
    may be None (a streamed HuggingFace dataset): then there is no percentage and no ETA. ``skipped`` bytes (work an
    earlier, interrupted run already did) count toward the total but not toward the speed. ``unit``: ``MB`` counts
    bytes, shown in MB; anything else counts items (``pairs``, ``parts``)."""

    def __init__(self, what: str, total: int | None, where: str, *, stream: TextIO | None = None,
                 interval: float | None = None, skipped: int = 0, unit: str = "MB"):
        self.what, self.total, self.where, self.unit = what, total, where, unit
        self.scale = _MB if unit == "MB" else 1
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self.start = time.monotonic()
        self.skipped = skipped
        self.done = skipped
        self.note = ""
        self._last = 0.0
        self._write(f"{what}: {self._amount(total)}" + (f" → {where}" if where else "")
                    + (f" (resuming: {self._amount(skipped)} done)" if skipped else ""), final=True)

    def update(self, done: int, note: str = "") -> None:
        """``note``: what is being done now, shown after the counts."""
        self.done, self.note = done, note
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._write(self.line(now), final=False)

    def close(self, summary: str = "") -> None:
        self.note = ""
        self._write(self.line(time.monotonic()) + (f"; {summary}" if summary else ""), final=True)

    def _amount(self, n: int | None) -> str:
        if n is None:
            return "size unknown"
        return f"{n / _MB:,.1f} MB" if self.unit == "MB" else f"{n:,} {self.unit}"

    def line(self, now: float) -> str:
        seconds = max(now - self.start, 1e-9)
        rate = (self.done - self.skipped) / seconds
        count = f"{self.done / _MB:,.1f}" if self.unit == "MB" else f"{self.done:,}"
        parts = [f"{self.what}: {count}"]
        if self.total:
            fraction = min(self.done / self.total, 1.0)
            parts[0] += f" / {self._amount(self.total)} ({100 * fraction:.0f}%)"
            if self.tty:
                filled = int(fraction * 24)
                parts.insert(0, "[" + "#" * filled + "." * (24 - filled) + "]")
        else:
            parts[0] += f" {self.unit}"
        parts.append(f"{rate / self.scale:.2f} {self.unit}/s")
        parts.append(f"{seconds:.0f}s")
        if self.total and rate > 0 and self.done < self.total:
            parts.append(f"ETA {_duration((self.total - self.done) / rate)}")
        if self.note:
            parts.append(self.note)
        return "  ".join(parts)

    def _write(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"
