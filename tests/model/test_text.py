from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.config import ModelConfig, TokenizerConfig
from hicache.text import ByteTokenizer, DecodeStream, TokenizerError, load_tokenizer
from hicache.text.byte_level import BOS, EOT


def test_byte_tokenizer_round_trip_and_specials() -> None:
    tok = load_tokenizer(TokenizerConfig())
    assert isinstance(tok, ByteTokenizer)
    text = "héllo wörld ✓"
    ids = tok.encode(text, add_special_tokens=True)
    assert ids[0] == BOS and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("a<|eot|>b") == [97, EOT, 98]
    assert tok.decode([97, EOT, 98], skip_special_tokens=False) == "a<|eot|>b"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat, skip_special_tokens=False) == "<|bos|>user: hi<|eot|>assistant: "
    assert EOT in tok.eos_token_ids
    with pytest.raises(TokenizerError, match="message 0"):
        tok.apply_chat_template([{"role": "user"}])


def test_decode_stream_holds_back_partial_characters() -> None:
    tok = ByteTokenizer()
    stream = DecodeStream(tok)
    pieces = [stream.push(i) for i in "aé✓".encode()]
    assert "".join(pieces) == "aé✓"
    assert pieces[1] == ""  # first byte of é


def _write_hf_tokenizer(root: Path, template: str | None) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="the 'tokenizers' package is not installed")
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "user": 5, ":": 6}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<s>", "</s>"])
    tk.decoder = tokenizers.decoders.WordPiece(prefix="##")
    root.mkdir(parents=True, exist_ok=True)
    tk.save(str(root / "tokenizer.json"))
    cfg: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        cfg["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_hf_tokenizer_with_chat_template(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {{ eos_token }} {% endfor %}"
        "{% if add_generation_prompt %}hello{% endif %}"
    )
    _write_hf_tokenizer(tmp_path / "tok", template)
    tok = load_tokenizer(TokenizerConfig(path=str(tmp_path / "tok")))
    assert tok.encode("hello world") == [3, 4]
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 0
    ids = tok.apply_chat_template([{"role": "user", "content": "world"}])
    assert ids == [0, 5, 6, 4, 1, 3]
    # an hf model directory with a tokenizer.json is used when tokenizer.path is unset
    tok2 = load_tokenizer(TokenizerConfig(), ModelConfig(kind="hf", path=str(tmp_path / "tok")))
    assert tok2.encode("world") == [4]


def test_hf_tokenizer_errors(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers", reason="the 'tokenizers' package is not installed")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path / "nope")))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(TokenizerConfig(path=str(tmp_path)))
    _write_hf_tokenizer(tmp_path / "t2", "{{ raise_exception('no system role') }}")
    tok = load_tokenizer(TokenizerConfig(path=str(tmp_path / "t2")))
    with pytest.raises(TokenizerError, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_decode_stream_pieces_add_up_to_the_whole_decode(tmp_path: Path) -> None:
    """Streaming decodes a short window per token; joined, the pieces are the one-shot decode
    (byte-level with multi-byte characters split across tokens, and a WordPiece decoder that
    puts spaces between words but not before the first)."""
    import random

    rng = random.Random(3)
    byte_tok = ByteTokenizer()
    for _ in range(50):
        text = "".join(rng.choice(["a", "é", "✓", " ", "😀", "z"]) for _ in range(rng.randrange(1, 30)))
        ids = byte_tok.encode(text)
        stream = DecodeStream(byte_tok)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == byte_tok.decode(ids) == text
    # a stream cut in the middle of a character gives the replacement character at flush
    stream = DecodeStream(byte_tok)
    assert stream.push("é".encode()[0]) == "" and stream.flush() == byte_tok.decode(["é".encode()[0]])

    _write_hf_tokenizer(tmp_path / "hf", None)
    hf = load_tokenizer(TokenizerConfig(path=str(tmp_path / "hf")))
    for _ in range(30):
        ids = [rng.choice([3, 4, 5, 6, 1]) for _ in range(rng.randrange(1, 40))]
        stream = DecodeStream(hf)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == hf.decode(ids, skip_special_tokens=True)
