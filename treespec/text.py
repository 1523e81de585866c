"""Token ids to text as they arrive, for streaming.

    text = TextStream(tokenizer, sys.stdout)
    for step in treespec.stream(model, draft, "cpu", ids):
        text.push(step.tokens[0])
    text.push([], final=True)

Decoding each step's tokens alone goes wrong twice: a character whose bytes span several
tokens (byte-level BPE: an emoji, an accented letter) decodes as U+FFFD halves, and
SentencePiece tokenizers drop or add a word's leading space at a token boundary. So every
push decodes all ids so far and emits the new suffix, holding it back while the text ends
in U+FFFD (the last character's bytes are not all there yet).
"""

from __future__ import annotations

from typing import Iterable, TextIO

__all__ = ["TextStream"]

_HALF = "\ufffd"  # what a tokenizer decodes a character's incomplete bytes to


class TextStream:
    """The text of a growing list of token ids, emitted in pieces that are whole characters.

    tokenizer: decodes the ids (``skip_special_tokens=True``).
    out:       where pieces are written and flushed as they come (e.g. ``sys.stdout``), or
               None: :meth:`push` only returns them.
    """

    def __init__(self, tokenizer, out: TextIO | None = None):
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.text = ""  # emitted so far

    def push(self, tokens: Iterable[int], final: bool = False) -> str:
        """Add ``tokens``; return (and write to ``out``) the text they complete. ``final``:
        the ids are all there, so a trailing U+FFFD is the text's own and is emitted."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith(_HALF) and not final:
            return ""
        piece, self.text = text[len(self.text):], text
        if self.out is not None and piece:
            self.out.write(piece)
            self.out.flush()
        return piece
