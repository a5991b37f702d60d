"""Log-probabilities in OpenAI's shapes: the chat `logprobs.content` list and the completions `logprobs` object
(tokens, token_logprobs, top_logprobs, text_offset), from the engine's TokenLogprob entries (engine/sequence.py).

A token's string is its own decoding (special tokens included); a byte-level token that is part of a multi-byte
character decodes to U+FFFD, and its `bytes` are those of that string (as vLLM does).  A log-probability of -inf (a
token outside the request's top-k / top-p) is sent as -9999.0: JSON has no infinity.
"""

from __future__ import annotations

import math

from specjax.engine.sequence import TokenLogprob
from specjax.model.tokenizer import Tokenizer

NEG_INF_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


class TokenText:
    """Token id -> its string, cached (the vocabulary's top alternatives repeat across positions)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                    else f"token_id:{token_id}")
            self.cache[token_id] = text
        return text


def chat_content(entries: list[TokenLogprob], text: TokenText) -> list[dict]:
    """Chat completions' `choices[i].logprobs.content` for the given tokens."""
    def item(token_id: int, logprob: float) -> dict:
        s = text(token_id)
        return {"token": s, "logprob": finite(logprob), "bytes": list(s.encode("utf-8"))}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


class CompletionLogprobs:
    """Completions' `choices[i].logprobs`, built piece by piece (streaming sends one piece per chunk): `text_offset`
    counts characters of the choice's whole text, from `offset` (the echoed prompt's length with echo)."""

    def __init__(self, text: TokenText, offset: int = 0):
        self.text, self.offset = text, offset

    def piece(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        """The part of `token_ids` (with their entries; None for the echoed prompt's first token, which nothing
        precedes: its logprob and top_logprobs are null, as OpenAI and vLLM send)."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, e in zip(token_ids, entries):
            s = self.text(token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if e is None else finite(e.logprob))
            out["top_logprobs"].append(None if e is None else self.top(e))
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def top(self, entry: TokenLogprob) -> dict[str, float]:
        """{token string: logprob}; tokens that decode alike (U+FFFD) keep the most likely one's value."""
        out: dict[str, float] = {}
        for t, lp in entry.top:
            out.setdefault(self.text(t), finite(lp))
        return out
