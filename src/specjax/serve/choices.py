"""The choices of one completion request in OpenAI's shapes: each choice follows one engine request (n > 1: one per
sample), whole or as stream chunks, with its text, token ids (specjax's `return_token_ids`), logprobs and echoed
prompt; `merged` interleaves the n requests' events as they come.
"""

from __future__ import annotations

import asyncio

from specjax.serve.logprobs import CompletionLogprobs, TokenText, chat_content
from specjax.serve.service import Event, RequestState


class Choice:
    """Choice `index` of a response, fed the events of its engine request.  `echo`: the prompt's text, sent first
    (with the prompt tokens' logprobs when logprobs are asked); `send_tokens` False (max_tokens 0 with echo): the one
    token generated is neither sent nor counted."""

    def __init__(self, index: int, state: RequestState, chat: bool, token_text: TokenText, echo: str | None,
                 send_tokens: bool, return_token_ids: bool):
        self.index, self.state, self.chat, self.token_text = index, state, chat, token_text
        self.echo, self.send_tokens, self.return_token_ids = echo, send_tokens, return_token_ids
        self.completion_logprobs = CompletionLogprobs(token_text)
        self.started = False  # a chunk (or the whole choice) was built
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.entries: list = []
        self.last: Event | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.state.params.logprobs is not None

    @property
    def completion_tokens(self) -> int:
        return self.last.completion_tokens if self.last is not None and self.send_tokens else 0

    def _logprobs(self, token_ids: list[int], entries: list):
        if not self.wants_logprobs:
            return None
        if not self.send_tokens:
            token_ids, entries = [], []
        if self.chat:
            return {"content": chat_content(entries, self.token_text)}
        prompt = None
        if self.echo is not None and not self.started:  # the prompt's tokens first (the first one has no logprob)
            prompt = self.completion_logprobs.piece(self.state.prompt_ids, self.state.prompt_logprobs)
        piece = self.completion_logprobs.piece(token_ids, entries)
        return piece if prompt is None else {k: prompt[k] + piece[k] for k in piece}

    def _body(self, text: str, finish: str | None, delta: bool, logprobs, token_ids: list[int]) -> dict:
        reason = None if finish is None else ("length" if finish == "length" else "stop")
        if self.chat:
            body = {"delta": {"content": text}} if delta else {"message": {"role": "assistant", "content": text}}
            out = {"index": self.index, **body, "finish_reason": reason, "logprobs": logprobs}
        else:
            out = {"index": self.index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        if self.return_token_ids:
            out["token_ids"] = token_ids
        return out

    def add(self, ev: Event) -> None:
        """Collect an event (unstreamed)."""
        self.text.append(ev.text)
        self.token_ids += ev.token_ids
        self.entries += ev.logprobs or []
        self.last = ev

    def whole(self) -> dict:
        """The choice once its request finished (unstreamed)."""
        token_ids = self.token_ids if self.send_tokens else []
        text = (self.echo or "") + ("".join(self.text) if self.send_tokens else "")
        logprobs = self._logprobs(token_ids, self.entries)
        self.started = True
        return self._body(text, self.last.finish_reason, False, logprobs, token_ids)

    def chunk(self, ev: Event) -> dict | None:
        """The stream chunk's choice for an event, or None when it carries nothing to send."""
        self.last = ev
        ids = ev.token_ids if self.send_tokens else []
        text = ev.text if self.send_tokens else ""
        first_echo = self.echo is not None and not self.started
        if first_echo:
            text = self.echo + text
        carries_tokens = (self.return_token_ids or self.wants_logprobs) and ids
        if not (text or ev.finished or carries_tokens or first_echo):
            return None
        logprobs = self._logprobs(ev.token_ids, ev.logprobs or [])
        self.started = True
        return self._body(text, ev.finish_reason if ev.finished else None, True, logprobs, ids)


async def merged(states: list[RequestState]):
    """(index, event) of n requests' events, in the order they arrive, until every request finished."""
    pending = {asyncio.ensure_future(s.events.get()): i for i, s in enumerate(states)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                ev = task.result()
                if not ev.finished:
                    pending[asyncio.ensure_future(states[i].events.get())] = i
                yield i, ev
    finally:
        for task in pending:
            task.cancel()
