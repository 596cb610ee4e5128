"""The built-in byte-level tokenizer (used when ``tokenizer.path`` is not set).

Ids 0..255 are the bytes of the UTF-8 text; then four special tokens:

=====  ================  ==========================================
id     text              use
=====  ================  ==========================================
256    ``<|bos|>``       start of a sequence
257    ``<|eos|>``       end of generation
258    ``<|pad|>``       padding
259    ``<|eot|>``       end of a chat turn (also ends generation)
=====  ================  ==========================================

``encode`` turns the special tokens' texts into their ids; ``decode`` renders them back
(or drops them with ``skip_special_tokens``). The chat template is trivial::

    <|bos|>{role}: {content}<|eot|>...{"assistant: " if add_generation_prompt}
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hicache.text.base import ChatMessage, TokenizerError

BOS, EOS, PAD, EOT = 256, 257, 258, 259
SPECIAL_TOKENS: dict[str, int] = {"<|bos|>": BOS, "<|eos|>": EOS, "<|pad|>": PAD, "<|eot|>": EOT}
BYTE_VOCAB_SIZE = 260
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
_SPECIAL_TEXT = {v: k for k, v in SPECIAL_TOKENS.items()}


class ByteTokenizer:
    """UTF-8 bytes plus four special tokens; ``vocab_size`` is 260 (the model may have more)."""

    vocab_size = BYTE_VOCAB_SIZE
    bos_token_id: int | None = BOS
    eos_token_ids: tuple[int, ...] = (EOS, EOT)
    pad_token_id: int | None = PAD

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [BOS] if add_special_tokens else []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(SPECIAL_TOKENS[m.group()])
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if i in _SPECIAL_TEXT:
                if not skip_special_tokens:
                    out.append(_SPECIAL_TEXT[i])
            elif not skip_special_tokens:
                out.append(f"<|{i}|>")  # an id the model has but the tokenizer does not name
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        ids = [BOS]
        for n, msg in enumerate(messages):
            role, content = msg.get("role"), msg.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise TokenizerError(f"message {n} needs string 'role' and 'content' fields")
            ids.extend(f"{role}: {content}".encode())
            ids.append(EOT)
        if add_generation_prompt:
            ids.extend(b"assistant: ")
        return ids
