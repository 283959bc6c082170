"""Token sampling from fp32 logits: penalties, temperature, min-p / top-k / top-p, logprobs.

Order per row (as vLLM): repetition / frequency / presence penalties on the raw logits; greedy
rows take the argmax there.  Other rows: divide by the temperature, drop tokens under
``min_p * max_prob``, keep the ``top_k`` largest, keep the smallest prefix of the sorted
distribution whose mass reaches ``top_p``, then sample from ``softmax`` in fp32 by an exponential
race, ``argmax(p / E)`` with ``E ~ Exp(1)`` (spec §5; equivalent to multinomial sampling).

A request with a ``seed`` draws its noise from its own ``torch.Generator``, so its samples do not
depend on what else is in the batch; other requests share the sampler's generator.
Log-probabilities are those of the raw logits (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.engine.sampling_params import SamplingParams

# (token id, logprob, 1-based rank)
TokenLogprob = tuple[int, float, int]


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: list[int] | None = None  # repetition penalty looks at prompt + output
    output_token_ids: list[int] | None = None  # all penalties look at the output


@dataclass
class RowLogprobs:
    """The sampled (or actual) token's logprob and rank, and the top-N of its row."""

    token: TokenLogprob
    top: list[TokenLogprob]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[RowLogprobs | None]


class Sampler:
    """Samples one token per row of logits; see the module docstring for the order of steps.

    Args:
        device: where generators are created (the logits' device).
        seed: seed of the generator shared by rows without their own seed.
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = self.make_generator(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        """A generator on the sampler's device seeded with ``seed`` (one per seeded sequence)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return gen

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of ``logits`` [R, V] (fp32)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"sampler: logits of shape {tuple(logits.shape)} for {len(rows)} rows; "
                             "expected [rows, vocab]")
        raw = logits.float()
        token_list = self.sample_tokens(raw, rows).tolist()
        want = [r.params.logprobs for r in rows]
        logprobs: list[RowLogprobs | None] = [None] * len(rows)
        if any(k is not None for k in want):
            idx = [i for i, k in enumerate(want) if k is not None]
            got = token_logprobs(raw[torch.tensor(idx, device=raw.device)],
                                 [token_list[i] for i in idx], [want[i] for i in idx])
            for i, lp in zip(idx, got):
                logprobs[i] = lp
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    @torch.no_grad()
    def sample_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The sampled token ids [R] (int64, on the logits' device; no host sync): the part of
        :meth:`sample` a pipelined decode step enqueues before the next step."""
        raw = logits.float()
        processed = self._apply_penalties(raw, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=raw.device)

        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=raw.device)
            tokens[g] = processed[g].argmax(dim=-1)
        if random:
            r_idx = torch.tensor(random, device=raw.device)
            sub_rows = [rows[i] for i in random]
            probs = self._filtered_probs(processed[r_idx], sub_rows)
            tokens[r_idx] = self._exponential_race(probs, sub_rows)

        return tokens

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        rows_with = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if not rows_with:
            return logits
        out = logits.clone()
        vocab = logits.shape[1]
        for i in rows_with:
            p = rows[i].params
            row = out[i]
            outputs = torch.tensor(rows[i].output_token_ids or [], dtype=torch.long,
                                   device=logits.device)
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                prompt = torch.tensor(rows[i].prompt_token_ids or [], dtype=torch.long,
                                      device=logits.device)
                seen[prompt] = True
                seen[outputs] = True
                scaled = torch.where(row > 0, row / p.repetition_penalty,
                                     row * p.repetition_penalty)
                row.copy_(torch.where(seen, scaled, row))
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                counts = torch.zeros(vocab, dtype=torch.float32, device=logits.device)
                counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return out

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, then min-p, top-k and top-p; returns fp32 probabilities [R, V]."""
        device = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32,
                             device=device)
        scaled = logits / temps.unsqueeze(1)
        min_ps = [r.params.min_p for r in rows]
        if any(m > 0 for m in min_ps):
            probs = scaled.softmax(dim=-1)
            thresh = torch.tensor(min_ps, dtype=torch.float32, device=device).unsqueeze(1)
            too_small = probs < thresh * probs.max(dim=-1, keepdim=True).values
            scaled = scaled.masked_fill(too_small, float("-inf"))
        top_ks = [r.params.top_k if r.params.top_k > 0 else 0 for r in rows]
        top_ps = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
            scaled = _top_k_top_p(scaled, top_ks, top_ps)
        return scaled.softmax(dim=-1)

    def _exponential_race(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            draw = torch.empty((len(shared), probs.shape[1]), dtype=probs.dtype, device=probs.device)
            draw.exponential_(generator=self.generator)
            noise[torch.tensor(shared, device=probs.device)] = draw
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        # Exp(1) is never 0 in exact arithmetic; guard the division anyway.
        return (probs / noise.clamp_min(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)

    # ------------------------------------------------------------------ prompt logprobs
    @torch.no_grad()
    def prompt_logprobs(self, logits: torch.Tensor, target_ids: list[int],
                        num_top: int) -> list[RowLogprobs]:
        """Logprob and rank of ``target_ids[i]`` under row i of ``logits``, plus the top-N."""
        return token_logprobs(logits.float(), target_ids, [num_top] * len(target_ids))


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask to -inf what falls outside each row's top-k (0 = off) and top-p (1.0 = off)."""
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device).clamp(max=vocab)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    ps = torch.tensor(top_ps, dtype=torch.float32, device=device).unsqueeze(1)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p; the first stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= ps) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   num_top: list[int]) -> list[RowLogprobs]:
    """Per row: log_softmax of the fp32 logits; the given token's logprob and 1-based rank
    (1 + the number of tokens with a strictly larger logprob) and the top ``num_top[i]``."""
    tok = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    return logprob_rows(token_ids, logprob_tensors(logits, tok, max(num_top, default=0)),
                        num_top)


LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> LogprobTensors:
    """The device half of :func:`token_logprobs` (no host sync): per row the logprob of
    ``tokens[i]`` [R], its rank [R], and the top-``num_top`` logprobs and ids [R, k] (None for
    k = 0)."""
    logp = logits.float().log_softmax(dim=-1)
    tok_lp = logp.gather(1, tokens.view(-1, 1))
    ranks = (logp > tok_lp).sum(dim=-1) + 1
    k_max = min(num_top, logp.shape[1])
    top_vals, top_ids = (logp.topk(k_max, dim=-1) if k_max > 0 else (None, None))
    return tok_lp.squeeze(1), ranks, top_vals, top_ids


def logprob_rows(token_ids: list[int], tensors: LogprobTensors,
                 num_top: list[int]) -> list[RowLogprobs]:
    """The host half of :func:`token_logprobs`: the rows of :func:`logprob_tensors`."""
    tok_lp, ranks, top_vals, top_ids = tensors
    tok_lp_l, ranks_l = tok_lp.tolist(), ranks.tolist()
    top_vals_l = top_vals.tolist() if top_vals is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    k_max = len(top_ids_l[0]) if top_ids_l else 0
    out = []
    for i, t in enumerate(token_ids):
        k = min(num_top[i], k_max)
        top = ([(top_ids_l[i][j], top_vals_l[i][j], j + 1) for j in range(k)]
               if top_ids_l is not None else [])
        out.append(RowLogprobs(token=(t, tok_lp_l[i], ranks_l[i]), top=top))
    return out
