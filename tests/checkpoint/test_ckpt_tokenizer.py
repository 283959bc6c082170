"""Tiny tokenizer and load_tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4.tokenizer import (BOS, EOS, PAD, SPECIAL_TOKENS, build_tiny_tokenizer, load_tokenizer,
                            make_tiny_tokenizer)


def test_tiny_tokenizer_special_tokens_and_size() -> None:
    tok = build_tiny_tokenizer()
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    for t in SPECIAL_TOKENS:
        ids = tok.encode(f"hello {t} world").ids
        assert ids.count(tok.token_to_id(t)) == 1, t
        assert tok.encode(t).ids == [tok.token_to_id(t)], t


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    make_tiny_tokenizer(tmp_path / "a")
    make_tiny_tokenizer(tmp_path / "b")
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json"
                                                            ).read_bytes()


def test_load_tokenizer(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    make_tiny_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 1)
    assert tok.model_max_length == 1048576 and len(tok) == 512
    text = "<｜User｜>The quick brown fox, 42 times!<｜Assistant｜></think>"
    ids = tok.encode(text)
    assert ids[0] == tok.convert_tokens_to_ids("<｜User｜>")  # no BOS added automatically
    assert tok.decode(ids) == text
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["bos_token"] == BOS


def test_v41_pad_token_and_added_token_dicts(tmp_path: Path) -> None:
    make_tiny_tokenizer(tmp_path, pad_token=PAD)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["bos_token"] = {"__type": "AddedToken", "content": BOS, "lstrip": False}
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.pad_token_id) == (0, 2)
    with pytest.raises(ValueError, match="pad_token"):
        make_tiny_tokenizer(tmp_path / "x", pad_token="<pad>")


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    make_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match="tokenizer.json: cannot load tokenizer"):
        load_tokenizer(tmp_path)
