"""Tokenizer: HF `tokenizers` (tokenizer.json) plus the chat template of tokenizer_config.json.

Only what the policy needs: encode/decode of token ids, special and added tokens, and the chat
template rendered with jinja2 the way transformers renders it (sandboxed environment,
trim_blocks/lstrip_blocks, a `tojson` that does not HTML-escape, `raise_exception`), so a prompt
built here tokenizes to the same ids that transformers and vLLM produce.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


def _token_text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.get("content")  # {"content": ..., "__type": "AddedToken"}


def _jinja_env() -> ImmutableSandboxedEnvironment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None):
        self._tok = tokenizer
        self.config = dict(config or {})
        self.chat_template = chat_template
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        model_dir = os.fspath(model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        config: dict[str, Any] = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                try:
                    config = json.load(f)
                except json.JSONDecodeError as e:
                    raise TokenizerError(f"{config_path}: line {e.lineno}: invalid JSON: {e.msg}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if template is None and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        return cls(_HFTokenizer.from_file(path), config, template)

    # ------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _required_id(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{what} {token!r} is not in the vocabulary")
        return token_id

    @cached_property
    def eos_token_id(self) -> int | None:
        return self._required_id(self.eos_token, "eos_token")

    @cached_property
    def pad_token_id(self) -> int | None:
        return self._required_id(self.pad_token, "pad_token")

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(t_id for t_id, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Every added token's id, special or not (turn markers, <tool_call>, <tool_response>, EOS...)."""
        return frozenset(self._tok.get_added_tokens_decoder())

    # ------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str) -> list[int]:
        """The ids of `text` read as text only: never an added token, whatever it contains.

        What a tool prints goes into the prompt through here (PromptFormat.tool_turn_ids): encode()
        would read "<|im_end|>" or "</tool_response>" in it as the tokenizer's control tokens, so a
        call could close its own block, open forged ones or end the turn (issue 79). Text with no
        added token in it gets encode()'s ids unchanged; otherwise the tokenizer's own pipeline runs
        without its added vocabulary (normalizer, pre-tokenizer, model), so the literal characters
        become ordinary tokens and decode back to the same text."""
        ids = self.encode(text)
        if self.added_token_ids.isdisjoint(ids):
            return ids
        tok = self._tok
        normalized = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
        pieces = tok.pre_tokenizer.pre_tokenize_str(normalized) if tok.pre_tokenizer is not None else [(normalized, None)]
        ids = [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]
        if not self.added_token_ids.isdisjoint(ids):  # the model's own vocabulary spells one: split it up
            ids = [t.id for piece, _ in pieces for ch in piece for t in tok.model.tokenize(ch)]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = False, **kwargs):
        """Render `messages` with the model's chat template; `tokenize=True` returns ids."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        template = _jinja_env().from_string(self.chat_template)
        text = template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               eos_token=self.eos_token, bos_token=self.bos_token, pad_token=self.pad_token,
                               **kwargs)
        return self.encode(text) if tokenize else text
