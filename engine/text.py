"""Incremental detokenization: the text of a growing token list, decoding a short window per round.

Decoding the whole output every round made a long generation quadratic (4,000 tokens of the shipped tokenizer
take ~2 ms to decode, four times a whole round on the GPU). A window that starts one emitted chunk back keeps
the context that tokenizers need at a boundary (a leading-space marker, a multi-byte character split over
tokens).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to so far


class IncrementalText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list = []
        self.window = 0  # the window's first token: the start of the last emitted chunk
        self.read = 0  # tokens already turned into text

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list, final: bool = False) -> str:
        """Append tokens; return the text they complete. Text that ends in an incomplete character is held
        back until more tokens come, unless `final`."""
        self.ids.extend(new_ids)
        known = self._decode(self.ids[self.window:self.read])
        text = self._decode(self.ids[self.window:])
        if not final and (len(text) <= len(known) or text.endswith(REPLACEMENT)):
            return ""
        if not text.startswith(known):  # the tokenizer rewrote the boundary: resend from the window's start
            known = ""
        self.window, self.read = self.read, len(self.ids)
        return text[len(known):]
