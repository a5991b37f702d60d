"""Tokenizer, chat template and streaming detokenizer, built from a HF directory or from GGUF metadata."""

from __future__ import annotations

import json
import os
from datetime import datetime

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specjax.model.gguf_file import gguf_field

# Pre-tokenizer split patterns of the byte-level BPE families llama.cpp names in `tokenizer.ggml.pre`.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def gguf_pre_tokenizer(pre: str):
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3"):
        split = LLAMA3_SPLIT
    elif pre == "qwen2":
        split = QWEN2_SPLIT
    else:
        raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (smollm, gpt2, llama-bpe, qwen2)")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _token_content(tok) -> str | None:
    if tok is None or isinstance(tok, str):
        return tok
    return tok.get("content")


class Tokenizer:
    """Text <-> ids, chat formatting and the ids that end a turn."""

    def __init__(self, tk: HFTokenizer, chat_template: str | None, bos_token: str | None, eos_token: str | None,
                 add_bos: bool):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tk.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use --no-chat (plain completion)")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template already writes BOS where the model wants it: do not add another.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def from_hf_dir(path: str) -> "Tokenizer":
        tk = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        tcfg = {}
        tcfg_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(tcfg_path):
            with open(tcfg_path, encoding="utf-8") as fh:
                tcfg = json.load(fh)
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as fh:
                template = fh.read()
        bos = _token_content(tcfg.get("bos_token"))
        # HF tokenizer.json post-processors may add BOS themselves; we add it explicitly instead.
        tk.no_padding()
        return Tokenizer(tk, template, bos, _token_content(tcfg.get("eos_token")),
                         add_bos=bool(tcfg.get("add_bos_token", False)) and bos is not None)

    @staticmethod
    def from_gguf(reader, source: str = "") -> "Tokenizer":
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{source}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges") or []]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = gguf_pre_tokenizer(gguf_field(reader, "tokenizer.ggml.pre", "gpt2"))
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                               for t, ty in zip(tokens, types) if ty in (3, 4)])
        bos_id = gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos_id = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        return Tokenizer(
            tk,
            gguf_field(reader, "tokenizer.chat_template"),
            tokens[bos_id] if bos_id is not None else None,
            tokens[eos_id] if eos_id is not None else None,
            add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
        )


class StreamDecoder:
    """Incremental detokenization: emit text only once it is stable (no dangling partial UTF-8 sequence).

    Decoding a window [prefix_offset, read_offset) and [prefix_offset, end) and emitting the difference keeps
    byte-level BPE merges and multi-byte characters split over several tokens correct.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids) -> str:
        self.ids.extend(int(i) for i in new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
