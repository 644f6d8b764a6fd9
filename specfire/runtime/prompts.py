"""The one prompt check of the front ends: text or token ids in, checked token ids out (or a
PromptError saying what is wrong), for an LLM and for the server's view of a model loaded in its
engine process alike."""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..errors import PromptError, SpecfireError
from ..tokenizer import ChatIds, Tokenizer


def check_prompt_ids(ids: list[int], vocab: int, max_seq: int) -> None:
    """Refuse a prompt the engine cannot take: empty, a non-integer or out-of-vocabulary id, no room left."""
    if len(ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool):
            raise ValueError(f"prompt token id {i!r} is not an integer")
        if not 0 <= i < vocab:
            raise ValueError(f"prompt token id {i!r} is out of range [0, {vocab})")
    if len(ids) >= max_seq:
        raise ValueError(f"prompt has {len(ids)} tokens; max_seq_len is {max_seq} "
                         f"(room for at least one generated token is needed)")


class Prompts:
    """The one prompt check (text or token ids -> checked ids) of an LLM and of the server's view of
    a model loaded in another process (serve/remote.py): `tokenizer`, `path`, `max_model_len`,
    `_check_open` and `_check_ids` (the engine's check of the ids) come from the subclass."""

    tokenizer: Tokenizer | None
    path: str
    max_model_len: int

    def _check_open(self) -> None:
        pass

    def _check_ids(self, ids: list[int]) -> None:
        raise NotImplementedError

    def _ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecfireError(f"{self.path} has no tokenizer.json; pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, ChatIds):           # a chat's ids keep their turn ends (Request takes them)
            return ChatIds(prompt, prompt.ends)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of `prompt`, checked as generate() checks them (check_prompt_ids); a bad
        prompt raises PromptError (`too_long` when it leaves no room to generate)."""
        self._check_open()
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PromptError(f"prompt has a lone surrogate {prompt[e.start]!r} at character {e.start}; "
                                  f"text must be valid Unicode") from None
            limit = 4 * self._max_token_chars * self.max_model_len
            if self.tokenizer is not None and len(prompt) > limit:
                # a token stands for at most _max_token_chars characters (x4 for what Unicode
                # normalization may compose), so this is too long without tokenizing it
                raise PromptError(f"prompt has {len(prompt)} characters, more than {limit} could fit in "
                                  f"max_seq_len {self.max_model_len} tokens", too_long=True)
        try:
            ids = self._ids(prompt)
        except (ValueError, TypeError) as e:
            raise PromptError(str(e)) from None
        try:
            self._check_ids(ids)
        except ValueError as e:
            raise PromptError(str(e), too_long=len(ids) >= self.max_model_len) from None
        return ids

    @functools.cached_property
    def _max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its longest vocabulary entry)."""
        assert self.tokenizer is not None
        return max(1, max(map(len, self.tokenizer.tok.get_vocab(with_added_tokens=True))))
