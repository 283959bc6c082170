"""V4.1 Engram (spec §4.7): hashed n-gram memory added to the multi-stream state.

Pieces, in the order the forward needs them:

* ``build_compressed_token_map`` — token id -> compressed id (normalized text classes);
* ``engram_primes`` / ``engram_offsets`` / ``hash_multipliers`` — the hash constants;
* ``NgramHasher`` — row ids of the 24 hash heads per engram layer, for a flat batch of requests,
  carrying each request's last ``max_ngram − 1`` compressed ids across steps;
* ``Engram`` — the module of one layer: looked-up rows (only those) -> ``wkv`` -> gated add.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["DEAD", "is_prime", "engram_primes", "build_compressed_token_map", "hash_multipliers",
           "engram_offsets", "ngram_row_ids", "NgramHasher", "gather_engram_rows", "EngramTable",
           "Engram"]

# e8m0 exponent bias: byte b is the scale 2^(b − 127) (spec §2.4).
_E8M0_BIAS = 127

# Deterministic Miller-Rabin witnesses: correct for every n < 3.3e24 (covers all int64).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic primality test for any 64-bit integer (Miller-Rabin, fixed bases)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(layer_ids: Sequence[int], max_ngram_size: int, n_heads: int,
                  vocab_size: int) -> list[list[list[int]]]:
    """Prime bucket sizes ``primes[layer][ngram_size − 2][head]`` (spec §4.7).

    Layers in ``layer_ids`` order, n-gram sizes 2..max_ngram_size, heads 0..n_heads−1; for each
    n-gram size the search restarts at ``vocab_size − 1`` and each head takes the smallest prime
    above the previous one that no earlier (layer, size, head) has taken.
    """
    if max_ngram_size < 2:
        raise ValueError(f"engram_primes: max_ngram_size must be >= 2, got {max_ngram_size}")
    if n_heads <= 0:
        raise ValueError(f"engram_primes: n_heads must be positive, got {n_heads}")
    if vocab_size < 1:
        raise ValueError(f"engram_primes: vocab_size must be positive, got {vocab_size}")
    used: set[int] = set()
    out: list[list[list[int]]] = []
    for _layer in layer_ids:
        per_size: list[list[int]] = []
        for _size in range(2, max_ngram_size + 1):
            current = vocab_size - 1
            heads: list[int] = []
            for _head in range(n_heads):
                current += 1
                while current in used or not is_prime(current):
                    current += 1
                used.add(current)
                heads.append(current)
            per_size.append(heads)
        out.append(per_size)
    return out


def _text_normalizer() -> Any:
    """The key normalizer of spec §4.7, built from ``tokenizers`` normalizers.

    Using the Rust normalizers (not Python's ``str.lower`` etc.) keeps the per-character
    semantics of the reference exactly (e.g. no final-sigma rule in Lowercase).
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # private use: protects a text that is exactly one space from Strip
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])


def _raw_tokenizer(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` from itself, a transformers fast tokenizer, or a wrapper."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for attr in ("backend_tokenizer", "_tokenizer", "tokenizer"):
        inner = getattr(tokenizer, attr, None)
        if isinstance(inner, Tokenizer):
            return inner
    raise ValueError(
        "build_compressed_token_map: expected a tokenizers.Tokenizer or a transformers fast "
        f"tokenizer (with .backend_tokenizer), found {type(tokenizer).__name__}")


def build_compressed_token_map(tokenizer: Any) -> tuple[list[int], int]:
    """Map every token id onto its compressed id (spec §4.7).

    Each id is decoded alone by the raw Rust tokenizer (special tokens kept); a text holding
    U+FFFD (a partial UTF-8 byte token) is keyed by the raw token string, any other text by its
    normalized form (the original text when that is empty).  Compressed ids are given in order of
    first appearance over ascending token ids.  Returns ``(token_map, compressed_vocab_size)``.
    """
    raw = _raw_tokenizer(tokenizer)
    norm = _text_normalizer()
    n = raw.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    token_map = [0] * n
    for tid in range(n):
        text = raw.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = raw.id_to_token(tid)
            if key is None:  # a hole in the id space: keep it distinct, deterministically
                key = f"\ufffd<missing {tid}>"
        else:
            key = norm.normalize_str(text) or text
        cid = key_to_id.get(key)
        if cid is None:
            cid = key_to_id[key] = len(key_to_id)
        token_map[tid] = cid
    return token_map, len(key_to_id)


# ---------------------------------------------------------------------------------- constants
# Seed stride of the per-layer multiplier generators (the reference's LAYER_SEED_PRIME).
_SEED_STRIDE = 10007

# Compressed id of a token that breaks n-grams (image-span tokens, and "before the sequence").
DEAD = -1


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int,
                     compressed_vocab_size: int) -> np.ndarray:
    """Odd int64 multipliers ``[n_layers, max_ngram_size]`` (spec §4.7).

    Per layer L: ``numpy.random.default_rng(10007·L)`` draws ``max_ngram_size`` values uniform in
    ``[0, bound)``, ``bound = max(1, (int64_max // compressed_vocab_size) // 2)``; multiplier
    ``2v + 1``.  The bound keeps ``compressed_id · multiplier`` inside int64.
    """
    if compressed_vocab_size <= 0:
        raise ValueError(f"hash_multipliers: compressed_vocab_size must be positive, got "
                         f"{compressed_vocab_size}")
    bound = max(1, (int(np.iinfo(np.int64).max) // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(_SEED_STRIDE * int(L)).integers(
        low=0, high=bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1 for L in layer_ids]
    if not rows:
        return np.zeros((0, max_ngram_size), dtype=np.int64)
    return np.stack(rows)


def engram_offsets(primes: list[list[list[int]]]) -> list[list[int]]:
    """Per layer, the exclusive prefix sums of its primes in [n-gram size][head] order."""
    out = []
    for layer in primes:
        flat = [p for size in layer for p in size]
        out.append([sum(flat[:i]) for i in range(len(flat))])
    return out


# ---------------------------------------------------------------------------------- hashing
def ngram_row_ids(cids: Tensor, cu_seqlens: Tensor, lookback: Tensor, multipliers: Tensor,
                  primes: Tensor, offsets: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """Table rows of every token of a flat batch (spec §4.7 "Hash ids", steps 2–4).

    ``cids`` [T] int64 compressed ids of the step's tokens (``DEAD`` = −1 for image tokens);
    ``cu_seqlens`` [R+1]; ``lookback`` [R, m−1] the compressed ids of the m−1 tokens before each
    request's first new token, oldest first (``DEAD`` before the sequence start);
    ``multipliers`` [n_layers, m], ``primes`` / ``offsets`` [n_layers, m−1, n_heads] int64.

    Returns ``row_ids`` [T, n_layers, (m−1)·n_heads] int64 (size-major, then head; offsets
    added) and the lookback to carry into the next step [R, m−1].
    """
    n_layers, m = multipliers.shape
    m1 = m - 1
    R = lookback.shape[0]
    T = cids.shape[0]
    if lookback.dim() != 2 or lookback.shape[1] != m1:
        raise ValueError(f"ngram_row_ids: lookback has shape {tuple(lookback.shape)}; expected "
                         f"[R, max_ngram_size − 1 = {m1}]")
    if tuple(cu_seqlens.shape) != (R + 1,):
        raise ValueError(f"ngram_row_ids: cu_seqlens has shape {tuple(cu_seqlens.shape)}; "
                         f"expected ({R + 1},) for {R} lookback rows")
    if tuple(primes.shape) != (n_layers, m1, primes.shape[-1]) or primes.shape != offsets.shape:
        raise ValueError(f"ngram_row_ids: primes {tuple(primes.shape)} / offsets "
                         f"{tuple(offsets.shape)} must both be [{n_layers}, {m1}, n_heads]")
    dev = cids.device
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    lookback = lookback.to(device=dev, dtype=torch.int64)
    seqlens = cu[1:] - cu[:-1]
    flat = torch.arange(T, device=dev)
    req = torch.repeat_interleave(torch.arange(R, device=dev), seqlens, output_size=T)
    local = flat - cu[req]  # index of the token inside its request's new tokens
    # One pool holding every request's lookback followed by the new ids: the id s places before
    # token i is either a new id (flat index i − s) or a lookback entry of its request.
    pool = torch.cat([lookback.reshape(-1), cids.to(torch.int64)])
    blocked = torch.zeros(T, dtype=torch.bool, device=dev)
    toks = []
    for s in range(m):
        in_lookback = local < s
        lb_index = req * m1 + m1 + local - s
        new_index = R * m1 + (flat - s).clamp_min(0)
        src = pool[torch.where(in_lookback, lb_index, new_index)]
        blocked = blocked | (src < 0)  # sticky: an n-gram never reaches across a DEAD token
        toks.append(torch.where(blocked, torch.full_like(src, pad_id), src))
    tok = torch.stack(toks, dim=1)  # [T, m]
    prod = tok[:, None, :] * multipliers.to(dev)[None, :, :]  # [T, n_layers, m], fits int64
    primes = primes.to(dev)
    roll = prod[..., 0]
    cols = []
    for i in range(1, m):
        roll = torch.bitwise_xor(roll, prod[..., i])
        cols.append(torch.remainder(roll[..., None], primes[None, :, i - 1, :]))
    row_ids = torch.stack(cols, dim=2) + offsets.to(dev)[None]  # [T, n_layers, m−1, n_heads]

    # New lookback: the last m−1 entries of [lookback_r, new ids of r].
    j = torch.arange(m1, device=dev)[None, :]
    ext = seqlens[:, None] + j  # index in the extended sequence of length m−1 + n_r
    from_lb = ext < m1
    idx = torch.where(from_lb, torch.arange(R, device=dev)[:, None] * m1 + ext,
                      R * m1 + cu[:-1, None] + ext - m1)
    new_lookback = pool[idx]
    return row_ids.reshape(T, n_layers, m1 * primes.shape[-1]), new_lookback


class NgramHasher:
    """The Engram hash state machine of one model: token map + constants of every engram layer.

    ``hasher(input_ids, cu_seqlens, lookback, token_mask)`` gives the row ids of all engram
    layers for a flat batch and the lookback to carry over; ``fresh_lookback(R)`` is the
    lookback of requests that start at position 0.
    """

    def __init__(self, token_map: Sequence[int] | Tensor, layer_ids: Sequence[int],
                 max_ngram_size: int, n_heads: int, vocab_size: int, compressed_vocab_size: int,
                 pad_token_id: int, device: torch.device | str = "cpu") -> None:
        tm = torch.as_tensor(token_map, dtype=torch.int64)
        if tm.dim() != 1 or tm.numel() == 0:
            raise ValueError(f"NgramHasher: token_map must be a non-empty 1-D id list; got shape "
                             f"{tuple(tm.shape)}")
        if int(tm.min()) < 0 or int(tm.max()) >= compressed_vocab_size:
            raise ValueError(f"NgramHasher: token_map values must lie in 0..{compressed_vocab_size - 1}"
                             f" (engram_compressed_vocab_size); found {int(tm.min())}..{int(tm.max())}")
        if not 0 <= pad_token_id < tm.numel():
            raise ValueError(f"NgramHasher: engram_pad_id={pad_token_id} is outside the token map "
                             f"(size {tm.numel()})")
        self.layer_ids = tuple(int(x) for x in layer_ids)
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.lookback_len = self.max_ngram_size - 1
        p = engram_primes(self.layer_ids, max_ngram_size, n_heads, vocab_size)
        self.primes_list = p
        self.num_rows = [sum(sum(h) for h in layer) for layer in p]
        self.token_map = tm.to(device)
        self.pad_id = int(tm[pad_token_id])
        self.multipliers = torch.from_numpy(
            hash_multipliers(self.layer_ids, max_ngram_size, compressed_vocab_size)).to(device)
        self.primes = torch.tensor(p, dtype=torch.int64, device=device).reshape(
            len(self.layer_ids), self.lookback_len, self.n_heads)
        self.offsets = torch.tensor(engram_offsets(p), dtype=torch.int64, device=device).reshape(
            self.primes.shape)

    @classmethod
    def from_config(cls, cfg: Any, token_map: Sequence[int] | Tensor,
                    compressed_vocab_size: int | None = None,
                    device: torch.device | str = "cpu") -> "NgramHasher":
        """Build from a V4.1 ``ModelConfig`` and a token map; checks the config's facts.

        ``compressed_vocab_size`` (as returned by ``build_compressed_token_map``) must equal
        ``engram_compressed_vocab_size``; the prime sums must equal ``engram_num_embeddings``.
        """
        if not cfg.engram_layer_ids:
            raise ValueError("NgramHasher.from_config: the config has no engram_layer_ids")
        if (compressed_vocab_size is not None
                and compressed_vocab_size != cfg.engram_compressed_vocab_size):
            raise ValueError(f"NgramHasher: the tokenizer gives a compressed vocabulary of "
                             f"{compressed_vocab_size} ids; config engram_compressed_vocab_size is "
                             f"{cfg.engram_compressed_vocab_size}")
        h = cls(token_map, cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id, device)
        if tuple(h.num_rows) != tuple(cfg.engram_num_embeddings):
            raise ValueError(f"NgramHasher: the engram primes give {h.num_rows} table rows per "
                             f"layer; config engram_num_embeddings is "
                             f"{list(cfg.engram_num_embeddings)}")
        return h

    def to(self, device: torch.device | str) -> "NgramHasher":
        """Move the constant tensors to ``device`` (in place); returns self."""
        for name in ("token_map", "multipliers", "primes", "offsets"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def fresh_lookback(self, num_requests: int, device: torch.device | str | None = None) -> Tensor:
        """[R, m−1] all ``DEAD``: the lookback of requests with nothing before them."""
        return torch.full((num_requests, self.lookback_len), DEAD, dtype=torch.int64,
                          device=device if device is not None else self.token_map.device)

    def compressed_ids(self, input_ids: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """[T] compressed ids; ``DEAD`` where ``token_mask`` is False (image tokens)."""
        if input_ids.device.type == "cpu" and input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.token_map.numel():
                raise ValueError(f"NgramHasher: input ids must lie in 0..{self.token_map.numel() - 1}"
                                 f" (the token map); found {lo}..{hi}")
        cids = self.token_map.to(input_ids.device)[input_ids.long()]
        if token_mask is not None:
            if tuple(token_mask.shape) != tuple(input_ids.shape):
                raise ValueError(f"NgramHasher: token_mask has shape {tuple(token_mask.shape)}; "
                                 f"expected {tuple(input_ids.shape)}")
            cids = torch.where(token_mask.bool(), cids, torch.full_like(cids, DEAD))
        return cids

    def __call__(self, input_ids: Tensor, cu_seqlens: Tensor, lookback: Tensor,
                 token_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Row ids [T, n_engram_layers, (m−1)·n_heads] and the next lookback [R, m−1]."""
        cids = self.compressed_ids(input_ids, token_mask)
        dev = cids.device
        return ngram_row_ids(cids, cu_seqlens, lookback, self.multipliers.to(dev),
                             self.primes.to(dev), self.offsets.to(dev), self.pad_id)

    def step_slots(self, input_ids: Tensor, cu_seqlens: Tensor, lookback_state: Tensor,
                   slots: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """Hash a step whose lookbacks live in ``lookback_state`` [num_slots, m−1] (updated)."""
        row_ids, new_lb = self(input_ids, cu_seqlens, lookback_state[slots], token_mask)
        lookback_state[slots] = new_lb.to(lookback_state.dtype)
        return row_ids


# ---------------------------------------------------------------------------------- the module
# Floor of |dot| under the gate's square root (the reference's clamp value).
_GATE_CLAMP = 1e-6
# e4m3 values per e8m0 scale in a table row.
_TABLE_BLOCK = 32


def gather_engram_rows(weight: Tensor, scale: Tensor, row_ids: Tensor,
                       out_dtype: torch.dtype) -> Tensor:
    """Dequantize only the rows ``row_ids`` of an e4m3 table with e8m0 scales per 32 values.

    ``weight`` [rows, hd] float8_e4m3fn, ``scale`` [rows, hd/32] e8m0 (or its uint8 bytes);
    returns [*row_ids.shape, hd] in ``out_dtype`` on ``row_ids``' device.  The gather runs on
    the table's device (the table may live in host memory), the arithmetic on the rows only.
    """
    hd = weight.shape[-1]
    flat = row_ids.reshape(-1).to(device=weight.device, dtype=torch.int64)
    w = torch.index_select(weight, 0, flat).to(row_ids.device)
    s = torch.index_select(scale, 0, flat).to(row_ids.device)
    if s.dtype != torch.uint8:
        s = s.view(torch.uint8)
    # e8m0 byte b encodes 2^(b − 127); exp2 of a small integer is exact in fp32.
    factor = torch.exp2(s.to(torch.float32) - _E8M0_BIAS)
    rows = w.to(torch.float32).view(-1, hd // _TABLE_BLOCK, _TABLE_BLOCK) * factor[..., None]
    return rows.view(*row_ids.shape, hd).to(out_dtype)


class EngramTable(nn.Module):
    """One engram layer's table, never dequantized whole (``lookup`` dequantizes the rows asked for).

    Quantized checkpoints: ``weight`` e4m3 [rows, hd] and ``scale`` e8m0 [rows, hd/32] (an
    "mxfp8" tensor pair).  Unquantized (bf16) checkpoints: a dense ``weight`` only.

    The loaded table is adopted, never copied into a buffer of its own: built on the ``meta``
    device (``load_model``) the table holds nothing until ``load_weight`` (a real V4.1 table is
    ~98 GB per layer).  ``device``, when given, is where the table lives (e.g. host memory):
    a loaded table elsewhere is moved there.
    """

    def __init__(self, num_rows: int, head_dim: int, quantized: bool = True,
                 dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if head_dim % _TABLE_BLOCK:
            raise ValueError(f"EngramTable: engram_head_dim={head_dim} must be a multiple of "
                             f"{_TABLE_BLOCK} (one e8m0 scale per {_TABLE_BLOCK} values)")
        self.num_rows = int(num_rows)
        self.head_dim = int(head_dim)
        self.quantized = quantized
        self.home = None if device is None else torch.device(device)
        wdtype = torch.float8_e4m3fn if quantized else dtype
        self.weight = nn.Parameter(torch.empty(num_rows, head_dim, dtype=wdtype, device=device),
                                   requires_grad=False)
        self.scale: nn.Parameter | None = None
        if quantized:
            self.scale = nn.Parameter(torch.empty(num_rows, head_dim // _TABLE_BLOCK,
                                                  dtype=torch.float8_e8m0fnu, device=device),
                                      requires_grad=False)

    def _target(self, value: Tensor) -> torch.device:
        if self.home is not None:
            return self.home
        return value.device if self.weight.is_meta else self.weight.device

    def load_weight(self, t: Any) -> None:
        """Take the checkpoint's table as is: a ``QuantWeight`` of fmt "mxfp8" (quantized
        tables) or a dense [rows, hd] tensor (unquantized ones).  Nothing is dequantized."""
        from dsv4.model.layers import set_parameter

        want = (self.num_rows, self.head_dim)
        if self.quantized:
            if getattr(t, "fmt", None) != "mxfp8":
                raise ValueError(f"EngramTable.load_weight: expected an mxfp8 QuantWeight (e4m3 "
                                 f"rows + e8m0 scales per 32); got {type(t).__name__} "
                                 f"{getattr(t, 'fmt', '')}")
            if tuple(t.shape) != want:
                raise ValueError(f"EngramTable.load_weight: table has shape {tuple(t.shape)}; "
                                 f"expected {want}")
            device = self._target(t.weight)
            set_parameter(self, "weight", t.weight.to(device))
            set_parameter(self, "scale", t.scale.to(device))
            return
        if not isinstance(t, Tensor) or tuple(t.shape) != want:
            raise ValueError(f"EngramTable.load_weight: expected a dense tensor of shape {want}; "
                             f"got {type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
        set_parameter(self, "weight", t.to(device=self._target(t), dtype=self.weight.dtype))

    def official_targets(self, prefix: str) -> dict[str, Any]:
        """The checkpoint name of the table (its ``.scale`` travels inside the QuantWeight)."""
        return {f"{prefix}weight": self.load_weight}

    def lookup(self, row_ids: Tensor, out_dtype: torch.dtype) -> Tensor:
        """[*row_ids.shape, head_dim] dequantized rows in ``out_dtype``."""
        if self.scale is None:
            flat = row_ids.reshape(-1).to(device=self.weight.device, dtype=torch.int64)
            rows = torch.index_select(self.weight, 0, flat).to(row_ids.device)
            return rows.view(*row_ids.shape, self.head_dim).to(out_dtype)
        return gather_engram_rows(self.weight, self.scale, row_ids, out_dtype)

    def extra_repr(self) -> str:
        return f"rows={self.num_rows}, head_dim={self.head_dim}, quantized={self.quantized}"


class Engram(nn.Module):
    """The Engram of one V4.1 layer (spec §4.7 "Engram module"), applied before its block.

    Parameters (checkpoint names under ``layers.{L}.engram.``): ``embed.weight`` / ``embed.scale``
    (the table), ``wkv.weight`` (FP8 Linear (m−1)·n_heads·hd → D·(n_hc+1)), ``q_weight`` and
    ``k_weight`` [n_hc, D].
    """

    def __init__(self, cfg: Any, layer_id: int, numerics: str = "bf16", ops: Any = None,
                 dtype: torch.dtype = torch.bfloat16,
                 table_device: torch.device | str | None = None, parallel: Any = None) -> None:
        super().__init__()
        from dsv4.dist.parallel import SINGLE
        from dsv4.model.layers import Linear, check_numerics

        if layer_id not in cfg.engram_layer_ids:
            raise ValueError(f"Engram: layer {layer_id} is not in engram_layer_ids "
                             f"{list(cfg.engram_layer_ids)}")
        self.layer_id = layer_id
        self.index = cfg.engram_layer_ids.index(layer_id)  # this layer's slot in the row ids
        self.numerics = check_numerics(numerics)
        self.ops = ops
        self.dim = cfg.dim
        self.hc_mult = cfg.hc_mult
        self.eps = cfg.norm_eps
        self.n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        # Several ranks: this rank holds table rows [row_lo, row_hi) (dsv4.dist.sharding).
        self.parallel = parallel or SINGLE
        self.row_lo, row_hi = self.parallel.split_ceil(cfg.engram_num_embeddings[self.index])
        self.embed = EngramTable(row_hi - self.row_lo, cfg.engram_head_dim,
                                 quantized=cfg.quantized, dtype=dtype, device=table_device)
        fmt = "fp8" if cfg.quantized else "bf16"
        self.wkv = Linear(self.n_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), fmt=fmt,
                          block=cfg.weight_block_size, numerics=numerics, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=dtype),
                                     requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim, dtype=dtype),
                                     requires_grad=False)

    def _gather(self, row_ids: Tensor, dtype: torch.dtype) -> Tensor:
        if self.parallel.enabled:
            # Rows held elsewhere read as zeros here; the sum over ranks completes every row
            # (one rank holds it, the others add exact zeros).
            local = row_ids - self.row_lo
            held = (local >= 0) & (local < self.embed.num_rows)
            if self.embed.num_rows:
                rows = self._gather_local(local.clamp(0, self.embed.num_rows - 1), dtype)
                rows = rows.masked_fill(~held[..., None], 0)
            else:
                rows = torch.zeros(*row_ids.shape, self.embed.head_dim, dtype=dtype,
                                   device=row_ids.device)
            return self.parallel.all_reduce(rows)
        return self._gather_local(row_ids, dtype)

    def _gather_local(self, row_ids: Tensor, dtype: torch.dtype) -> Tensor:
        op = getattr(self.ops, "engram_gather", None) if self.ops is not None else None
        if op is not None and self.embed.scale is not None:
            return op(self.embed.weight, self.embed.scale, row_ids, dtype)
        return self.embed.lookup(row_ids, dtype)

    def forward(self, x: Tensor, row_ids: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """``x`` [T, n_hc, D], ``row_ids`` [T, (m−1)·n_heads] (this layer's columns, offsets
        included), ``token_mask`` [T] bool (False = image token: gate 0) -> new ``x``."""
        T = x.shape[0]
        if tuple(x.shape[1:]) != (self.hc_mult, self.dim):
            raise ValueError(f"Engram: x has shape {tuple(x.shape)}; expected [T, {self.hc_mult}, "
                             f"{self.dim}]")
        if tuple(row_ids.shape) != (T, self.n_cols):
            raise ValueError(f"Engram: row_ids has shape {tuple(row_ids.shape)}; expected "
                             f"[{T}, {self.n_cols}]")
        if token_mask is not None and tuple(token_mask.shape) != (T,):
            raise ValueError(f"Engram: token_mask has shape {tuple(token_mask.shape)}; "
                             f"expected [{T}]")
        rows = self._gather(row_ids, self.wkv.weight.dtype)  # [T, cols, hd], exact in bf16
        kv = self.wkv(rows.reshape(T, -1))
        split = self.hc_mult * self.dim
        key = kv[:, :split].to(torch.float32).view(T, self.hc_mult, self.dim)
        value = kv[:, split:].to(torch.float32)
        # The reference only uses the product, rounded in the parameters' dtype.
        wqk = (self.q_weight * self.k_weight).to(torch.float32)
        h = x.to(torch.float32)
        # Normalized per stream copy over D (not jointly over the streams).
        rstd = (torch.rsqrt(h.square().mean(-1) + self.eps)
                * torch.rsqrt(key.square().mean(-1) + self.eps))
        dot = (h * wqk * key).sum(-1) * rstd * self.dim ** -0.5  # [T, n_hc]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(_GATE_CLAMP).sqrt(), dot))
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.bool()[:, None], 0.0)
        return (h + gate[..., None] * value[:, None, :]).to(x.dtype)
