"""Incremental, UTF-8 safe detokenization.

Tokens are byte strings; a character may span tokens. The incremental decoder keeps
an incomplete trailing sequence until the next bytes arrive, and replaces invalid
bytes with U+FFFD, so no invalid UTF-8 ever reaches a client.
"""

from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """End of generation: an unfinished character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)
