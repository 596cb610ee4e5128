"""Hugging Face ``tokenizers`` from a local ``tokenizer.json``, with its chat template.

Next to ``tokenizer.json`` the directory may hold ``tokenizer_config.json`` (chat
template, bos/eos/pad tokens) and ``generation_config.json`` (eos ids). The chat template
is rendered with jinja2 in a sandbox, as ``transformers`` does; without a template, a
plain ``role: content`` fallback is used; with a template but no jinja2 installed,
``apply_chat_template`` raises a TokenizerError saying so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache.text.base import ChatMessage, TokenizerError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of its directory."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:
            raise TokenizerError("tokenizer.path is set but the 'tokenizers' package is not installed") from exc
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(f"tokenizer file {file} does not exist")
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise TokenizerError(f"{file} is not a valid tokenizer.json: {exc}") from exc
        root = file.parent
        cfg = _read_json(root / "tokenizer_config.json")
        gen = _read_json(root / "generation_config.json")
        self.chat_template: str | None = None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            self.chat_template = template
        elif (root / "chat_template.jinja").is_file():
            self.chat_template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        eos_ids: list[int] = []
        gen_eos = gen.get("eos_token_id")
        for v in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(v, int) and v not in eos_ids:
                eos_ids.append(v)
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None and tid not in eos_ids:
                eos_ids.append(tid)
        self._eos = tuple(eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._tok.token_to_id(self.pad_token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The conversation as text (special tokens spelled out)."""
        if self.chat_template is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as exc:
            raise TokenizerError("this tokenizer has a chat template, which needs the 'jinja2' package") from exc

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        def strftime_now(fmt: str) -> str:
            from datetime import datetime

            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            return env.from_string(self.chat_template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
            )
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed to render: {exc}") from exc

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
