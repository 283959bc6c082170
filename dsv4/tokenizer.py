"""The checkpoint's tokenizer, and a tiny byte-level BPE one for generated test checkpoints.

DeepSeek-V4 ships a ``PreTrainedTokenizerFast`` (``tokenizer.json`` + ``tokenizer_config.json``)
with ``add_bos_token`` false: prompt builders add ``<｜begin▁of▁sentence｜>`` themselves (spec §5).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["SPECIAL_TOKENS", "BOS", "EOS", "PAD", "IMAGE_TOKEN", "load_tokenizer",
           "make_tiny_tokenizer", "build_tiny_tokenizer"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
# The DeepSeek special tokens, in tiny-tokenizer id order (BOS 0, EOS 1, PAD 2 as in the real one).
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, PAD, "<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<|EOT|>", "<think>",
    "</think>", "｜DSML｜", IMAGE_TOKEN, "<｜latest_reminder｜>", "<｜action｜>", "<｜query｜>",
    "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
)
TINY_VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 1048576

# Training text of the tiny BPE: plain English prose plus chat/code flavour, so that merges
# cover common words and a sampled tiny model produces readable-ish pieces.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of a
language: words, spaces, punctuation and numbers such as 1, 2, 3, 10, 42 and 2024.
Once upon a time there was a little town by the sea. Every morning the people of the town
walked to the market, where they bought bread, fish, apples and tea. The children played in
the street while their parents talked about the weather, the news and the price of things.
In the evening the lights came on one by one, and the town was quiet again.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
User: Please write a short poem about the moon.
Assistant: The moon is bright, the night is long; the stars above us sing their song.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
Machine learning models read text as tokens. A tokenizer splits the text into pieces and maps
each piece to a number. The model then predicts the next piece, one step at a time, until it
reaches the end of the sentence or the end of the answer.
It is important to test every part of a system: the numbers, the files, the model and the
server. When something is wrong, a good error message says what was expected and what was
found, so that the reader can fix the problem quickly.
"""


def _token_content(value: Any) -> str | None:
    """A tokenizer_config token entry: a string or an AddedToken dict ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: cannot read special token {value!r}")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The checkpoint's tokenizer as a ``transformers.PreTrainedTokenizerFast``.

    ``path`` is the checkpoint directory holding ``tokenizer.json`` and
    ``tokenizer_config.json``.  The tokenizer is built straight from ``tokenizer.json`` (whatever
    ``tokenizer_class`` the config names), with bos/eos/pad and ``model_max_length`` from the
    config; no BOS is added automatically.
    """
    from transformers import PreTrainedTokenizerFast

    path = os.fspath(path)
    tok_file = os.path.join(path, "tokenizer.json")
    cfg_file = os.path.join(path, "tokenizer_config.json")
    for f in (tok_file, cfg_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no tokenizer: {f} does not exist (a checkpoint directory "
                                    "needs tokenizer.json and tokenizer_config.json)")
    try:
        with open(cfg_file, encoding="utf-8") as fh:
            tcfg = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(tcfg, dict):
        raise ValueError(f"{cfg_file}: the top level must be a JSON object")
    kwargs: dict[str, Any] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(tcfg.get(key))
        if content is not None:
            kwargs[key] = content
    try:
        tok = PreTrainedTokenizerFast(
            tokenizer_file=tok_file,
            model_max_length=int(tcfg.get("model_max_length", MODEL_MAX_LENGTH)),
            clean_up_tokenization_spaces=bool(tcfg.get("clean_up_tokenization_spaces", False)),
            **kwargs)
    except Exception as e:  # the tokenizers library reports a corrupt file with its own type
        raise ValueError(f"{tok_file}: cannot load tokenizer ({e})") from None
    # DeepSeek prompt builders add BOS themselves (tokenizer_config add_bos_token is false).
    for flag in ("add_bos_token", "add_eos_token"):
        if hasattr(tok, flag):
            try:
                setattr(tok, flag, bool(tcfg.get(flag, False)))
            except Exception:  # pragma: no cover - older transformers make these read-only
                pass
    return tok


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Any:
    """The tiny byte-level BPE as a ``tokenizers.Tokenizer`` (deterministic; special tokens
    first, so ``<｜begin▁of▁sentence｜>`` is id 0, ``<｜end▁of▁sentence｜>`` 1, ``<｜▁pad▁｜>`` 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:  # pragma: no cover - guards a tokenizers behaviour change
            raise RuntimeError(f"tiny tokenizer: special token {t!r} got id "
                               f"{tok.token_to_id(t)}, expected {i}")
    return tok


def make_tiny_tokenizer(out_dir: str | os.PathLike, pad_token: str = EOS) -> Any:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` of the tiny tokenizer to ``out_dir``.

    ``pad_token`` is ``<｜end▁of▁sentence｜>`` for V4 and ``<｜▁pad▁｜>`` for V4.1 (spec §5).
    Returns the ``tokenizers.Tokenizer``.
    """
    if pad_token not in SPECIAL_TOKENS:
        raise ValueError(f"make_tiny_tokenizer: pad_token {pad_token!r} is not one of the "
                         f"special tokens {SPECIAL_TOKENS}")
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": pad_token,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return tok
