"""Start-up warm-up: synthetic requests through the engine's own path before it serves.

Triton compiles a kernel the first time a process meets a new specialization of it (its
constexpr plan, whether an integer argument is 1 or a multiple of 16), and dsv4 picks its
kernel plans by a step's token count, its number of sequences and what the cache holds
(compressed entries yet or not, more visible entries than the indexer keeps or not).  Each
first use costs 0.1-3 s of compiling on a fresh machine (loading from Triton's disk cache on a
warm one), so an engine that serves at once makes its first requests wait: on an H100 with 43
V4-Flash layers a first 256-token prompt took 3.4 s and the first steps of 16 such prompts
10.5 s and 20.6 s (docs/PERFORMANCE.md, twenty-fifth session).  The decode graphs' and the
prefill graphs' captures compile what they hold; the rest (chunked prefill, steps of odd
sizes, the cache part of piecewise steps, mixed steps) compiles on first use.

:func:`warmup_phases` lists the step kinds a server meets, as phases of requests (submitted
in waves a step apart); :func:`run_warmup` runs them through ``LLMEngine.add_request`` /
``step`` (greedy, so no random generator moves), checks that the engine is idle again and
restores its counters.
:func:`kernels_loaded` counts the Triton kernels this process has compiled or loaded, so a
benchmark or an operator can see that serving compiles nothing after the warm-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from dsv4.engine.prefill_graphs import PREFILL_BUCKETS
from dsv4.engine.sampling_params import SamplingParams

log = logging.getLogger("dsv4")

__all__ = ["WarmupRequest", "warmup_phases", "run_warmup", "kernels_loaded",
           "kernels_loaded_since"]

# Request ids of the warm-up (never seen by a client: the engine is idle again afterwards).
ID_PREFIX = "dsv4-warmup-"


@dataclass(frozen=True)
class WarmupRequest:
    """One synthetic request: ``prompt_len`` token ids, ``max_tokens`` greedy output tokens."""

    prompt_len: int
    max_tokens: int


# A phase is a list of waves: wave i + 1 is submitted one step after wave i (so its prompts
# meet wave i's decodes in one mixed step); the phase runs until all its requests finish.
Phase = list[list[WarmupRequest]]


def max_steps(phase: Phase, budget: int) -> int:
    """Steps after which a phase is given up (its requests aborted): a cache too small for it
    would otherwise keep them waiting forever.  Four times what it needs, plus slack for
    preemptions."""
    reqs = [r for wave in phase for r in wave]
    return 100 + 4 * (sum(r.prompt_len for r in reqs) // budget + sum(r.max_tokens for r in reqs))


def warmup_phases(*, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                  num_pages: int, page_size: int, index_topk: int, min_ratio: int
                  ) -> list[Phase]:
    """The warm-up's phases (each run to completion before the next).

    * a short request, then a long one (at least two steps' worth, so it is chunked; long
      enough that its smallest-ratio compressed entries pass the indexer's top-k
      ``index_topk`` up to four times over, so the top-k's plans for contexts up to there
      compile) whose first chunk meets the short one's decodes; then the long one alone;
    * every step size up to ``max_num_batched_tokens`` the prefill graphs' buckets name, and
      that budget itself, twice (the size, a multiple of 16, and 5 tokens fewer): one prompt,
      or several adding up to it where ``max_model_len`` is shorter;
    * two short requests, then prompts filling the rest of a full step (a mixed step of many
      prefills and decodes);
    * ``min(max_num_seqs, 16)`` short prompts at once (then decode steps of that batch).

    Every request fits ``max_model_len`` (prompt + output) and every phase the cache's pages;
    what does not is shortened (the long prompt) or left out.
    """
    short = WarmupRequest(17, 4)
    room = max_model_len - 2            # the longest prompt of a 2-token request

    def pages(phase: Phase) -> int:
        return sum(-(-(r.prompt_len + r.max_tokens) // page_size) for w in phase for r in w)

    def fits(phase: Phase) -> bool:
        reqs = [r for w in phase for r in w]
        return (all(r.prompt_len >= 1 and r.prompt_len + r.max_tokens <= max_model_len
                    for r in reqs) and pages(phase) <= num_pages
                and max(len(w) for w in phase) <= max_num_seqs)

    def step_of(tokens: int) -> list[WarmupRequest]:
        """Prompts that one step of ``tokens`` tokens prefills whole."""
        n = -(-tokens // room) if room > 0 else 0
        if n < 1:
            return []
        return [WarmupRequest(tokens // n + (i < tokens % n), 2) for i in range(n)]

    phases: list[Phase] = []
    # Two chunks at least (a continuation chunk); the top-k span four times over.
    span = max(2 * max_num_batched_tokens, 4 * index_topk * min_ratio) + 64
    # The long prompt leaves the short one a page and itself a spare one.
    long_len = min(span, max_model_len - 3, (num_pages - 2) * page_size - 3)
    if long_len > max(short.prompt_len, max_num_batched_tokens):
        # Twice: next to a decoding short request (chunks of odd sizes from odd positions)
        # and alone (chunks of the full budget from its multiples).  Triton specializes an
        # integer argument on whether it is a multiple of 16, and the chunks' lengths and
        # entry counts are such arguments (run E: 8K prompts still compiled top-k, compressor
        # and attention variants after the mixed pass alone).
        for phase in ([[short], [WarmupRequest(long_len, 3)]], [[WarmupRequest(long_len, 3)]]):
            if fits(phase):
                phases.append(phase)
    sizes = [b for b in PREFILL_BUCKETS if b < max_num_batched_tokens] + [max_num_batched_tokens]
    for size in sizes:
        for tokens in (size, size - 5):
            phase = [step_of(tokens)]
            if phase[0] and fits(phase):
                phases.append(phase)
    mixed = [[short, short], step_of(max_num_batched_tokens - 2)]
    if mixed[1] and fits(mixed):
        phases.append(mixed)
    batch = [[short] * min(max_num_seqs, 16)]
    if len(batch[0]) > 1 and fits(batch):
        phases.append(batch)
    return phases


def run_warmup(engine: Any) -> dict[str, Any]:
    """Run :func:`warmup_phases` through ``engine`` (idle, on its driver); returns what it did:
    ``seconds``, ``steps``, ``requests``, ``kernels_loaded`` (Triton kernels compiled or loaded
    meanwhile), ``aborted`` (requests of phases given up).  The engine is idle afterwards and
    its counters are as before (``get_stats``)."""
    engine.check_idle()
    cfg = engine.config
    mgr = engine.manager
    ratios = [r for r in cfg.compress_ratios[: cfg.n_layers] if r > 1]
    phases = warmup_phases(
        max_num_batched_tokens=engine.options.max_num_batched_tokens,
        max_num_seqs=engine.options.max_num_seqs, max_model_len=engine.max_model_len,
        num_pages=mgr.num_pages, page_size=mgr.page_size, index_topk=int(cfg.index_topk),
        min_ratio=min(ratios) if ratios else 0)
    totals = dict(engine._totals)
    preemptions = engine.scheduler.num_preemptions
    kernels0 = kernels_loaded()
    t0 = time.perf_counter()
    steps = requests = aborted = 0
    for p, phase in enumerate(phases):
        log.info("dsv4 engine: warm-up %d/%d: prompts of %s tokens", p + 1, len(phases),
                 " then ".join(_lengths(wave) for wave in phase))
        ids = [rid for wave in _ids(p, phase) for rid in wave]
        try:
            n = _run_phase(engine, p, phase)
        except Exception as e:
            engine.abort_request(ids)
            raise RuntimeError(f"the engine's start-up warm-up failed in phase {p + 1} (prompts "
                               f"of {' then '.join(_lengths(w) for w in phase)} tokens): "
                               f"{type(e).__name__}: {e}; warmup=False (--no-warmup) skips "
                               "it") from e
        requests += len(ids)
        steps += n
        if engine.has_unfinished_requests():
            log.warning("dsv4 engine: warm-up phase %d (%s) did not finish in %d steps; "
                        "aborted", p + 1, phase, n)
            aborted += engine.get_num_unfinished_requests()
            engine.abort_request(ids)
    engine.check_idle()
    engine._totals.update(totals)
    engine.scheduler.num_preemptions = preemptions
    stats = {"seconds": time.perf_counter() - t0, "steps": steps, "requests": requests,
             "kernels_loaded": kernels_loaded() - kernels0, "aborted": aborted}
    log.info("dsv4 engine: warm-up ran %d requests in %d steps in %.1f s (%d Triton kernels "
             "compiled or loaded)", requests, steps, stats["seconds"], stats["kernels_loaded"])
    return stats


def _lengths(wave: list[WarmupRequest]) -> str:
    """A wave's prompt lengths for the log: "17", "16x17" or "256+255"."""
    lens = [r.prompt_len for r in wave]
    if len(lens) == 1:
        return str(lens[0])
    if len(set(lens)) == 1:
        return f"{len(lens)}x{lens[0]}"
    return "+".join(map(str, lens))


def _ids(p: int, phase: Phase) -> list[list[str]]:
    """The request ids of phase ``p``, wave by wave."""
    return [[f"{ID_PREFIX}{p}-{w}-{i}" for i in range(len(wave))] for w, wave in enumerate(phase)]


def _run_phase(engine: Any, p: int, phase: Phase) -> int:
    """Submit phase ``p``'s waves one step apart and step until they finish (or its step
    limit); returns the steps run."""
    vocab = engine.config.vocab_size
    n = 0
    for w, (wave, wave_ids) in enumerate(zip(phase, _ids(p, phase))):
        for i, (r, rid) in enumerate(zip(wave, wave_ids)):
            # Distinct, deterministic token ids (no tokenizer, no random generator).
            seed = 7 + 31 * (p + 1) + 17 * (w + 1) * (i + 1)
            prompt = [(seed + 13 * k) % vocab for k in range(r.prompt_len)]
            engine.add_request(rid, prompt, SamplingParams(
                temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
        if w + 1 < len(phase):
            engine.step()
            n += 1
    limit = max_steps(phase, engine.options.max_num_batched_tokens)
    while engine.has_unfinished_requests() and n < limit:
        engine.step()
        n += 1
    return n


# ---------------------------------------------------------------------- kernel counter
_names: list[str] = []      # the names of the kernels compiled or loaded, in order
_hooked = False


def kernels_loaded() -> int:
    """Triton kernels this process has compiled or loaded from the disk cache so far (0 where
    Triton is absent or interpreted: nothing compiles).  The first call installs the counter:
    Triton's kernel-load hook (called once per new kernel binary, as it is loaded onto the
    device; chained to any hook already there).  Unlike the post-compile hook it costs Triton
    no serialization of the kernel's specialization."""
    global _hooked
    if not _hooked:
        _hooked = True
        try:
            from triton import knobs
        except ImportError:   # no Triton (or an older one without knobs): nothing to count
            return 0
        previous = knobs.runtime.kernel_load_end_hook

        def count(module: Any, function: Any, name: str, metadata_group: Any,
                  hash: Any) -> None:   # noqa: A002 - Triton's argument names
            _names.append(str(name))
            if previous is not None:
                previous(module, function, name, metadata_group, hash)

        knobs.runtime.kernel_load_end_hook = count
    return len(_names)


def kernels_loaded_since(count: int) -> list[str]:
    """The names of the kernels compiled or loaded after :func:`kernels_loaded`
    returned ``count``."""
    return list(_names[count:])
