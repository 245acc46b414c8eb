"""Tokenizers: a byte-level one for presets (no files, no network) or a folder's own."""

from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class ByteTokenizer:
    """ids = UTF-8 bytes modulo the vocabulary; decoding maps ids back modulo 256."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = None
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """transformers' AutoTokenizer from a model folder (encode adds the model's special tokens)."""

    def __init__(self, folder: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(folder)
        self.eos_token_id = self._tok.eos_token_id
        self.chat_template = getattr(self._tok, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` in the folder's chat template, ending with the assistant's
        generation prompt (the template adds its own special tokens, so none are added again)."""
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(folder: str | None, vocab_size: int):
    """The folder's tokenizer when it has tokenizer files, else :class:`ByteTokenizer`."""
    if folder and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return HFTokenizer(folder)
    return ByteTokenizer(vocab_size)
