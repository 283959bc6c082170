"""LLMEngine: requests in, RequestOutputs out, one step at a time (the API the server drives).

Each ``step()`` schedules a batch (decodes first, then chunked prefill), runs it through the
model runner, appends the sampled tokens, detokenizes incrementally, applies stop conditions and
returns the cumulative state of every request that produced a token or finished.

Length policy (as vLLM's offline engine): a prompt longer than ``max_model_len`` is rejected;
``max_tokens`` is not checked against the room left: generation simply ends with finish_reason
"length" when prompt + output reaches ``max_model_len`` (``max_tokens=None`` means exactly that).
An aborted request is freed at once and produces no further output.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.profiler import record_function

from dsv4.cache.formats import RECORD_DTYPE
from dsv4.cache.manager import CacheManager
from dsv4.config import ModelConfig
from dsv4.dist.parallel import Parallel, ParallelConfig, init_parallel
from dsv4.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from dsv4.engine.prefill_graphs import ENGINE_MAX_TOKENS
from dsv4.engine.runner import (InFlight, ModelRunner, StepResult, profile_decode_graph_bytes,
                               profile_peak_bytes, resolve_cache_dtype, size_cache)
from dsv4.engine.sampler import RowLogprobs
from dsv4.engine.sampling_params import (CompletionOutput, Logprob, PositionLogprobs,
                                         RequestMetrics, RequestOutput, SamplingParams)
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.sequence import Sequence, SequenceStatus
from dsv4.engine.warmup import kernels_loaded, run_warmup

log = logging.getLogger("dsv4")

# The process's kernel recorder (DSV4_RECORD_KERNELS), installed by the first engine.
_recorder: Any = None

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineOptions:
    """Engine options (keyword arguments of ``LLMEngine``), validated on construction.

    ``device`` None means "cuda" when available, else "cpu"; ``dtype`` None means float32 on
    CPU and bfloat16 on CUDA; ``backend`` None means "torch" on CPU and "triton" on CUDA;
    ``max_model_len`` None means min(config max, 8192).  ``kv_cache_dtype``: "fp8" stores the
    caches in the official low-precision records (V4: e4m3 nope + bf16 RoPE + ue8m0 scales;
    V4.1: e4m3 window, e2m1 compressed; e2m1 index keys; see dsv4.cache.formats), "bf16" as
    bf16 rows (bf16 models), "auto" (default) fp8 on CUDA and the model dtype on CPU.
    Cache size: ``num_pages``, or
    ``kv_cache_memory`` bytes, or (CUDA) ``gpu_memory_utilization``.
    ``tensor_parallel_size`` (default 1): processes (one GPU each) of a ``torchrun`` launch that
    split attention heads and the MoE; ``expert_parallel`` (default False) splits the routed
    experts by expert instead of by intermediate dim (see ``dsv4.dist``).
    ``enforce_eager`` (default False): no CUDA graphs; otherwise decode steps of up to
    ``cuda_graph_max_batch`` (default ``max_num_seqs``) sequences replay CUDA graphs, one per
    batch bucket (``dsv4.engine.cuda_graphs``), captured when the engine starts
    (``cuda_graph_capture="startup"``, the default: no request waits for a capture and its
    Triton compiles, seconds each) or on each bucket's first use (``"lazy"``: quicker start).
    ``cuda_graphs_under_tp`` (default True): also replay decode CUDA graphs under tensor /
    expert parallelism (every rank captures and replays the same graphs, NCCL collectives
    inside; the step announcement stays outside; tests/dist/test_tp_graphs_gpu.py passed on two
    H200s).  False runs such decode steps eagerly.
    ``pipeline_decode`` (default None: on when decode steps run as CUDA graphs): while a decode
    step runs on the device, the next one of the same sequences (each assumed to go on) is
    launched with the samples still on the device, before the host reads them — the host's
    work of a step (outputs, scheduling, planning, the graph launch) hides behind the device's.
    A sequence that stops at a step has its speculative next token discarded; only decode steps
    whose rows need no penalties and no prompt logprobs, with nothing waiting to be admitted,
    pipeline.  Each step computes what the unpipelined engine computes, except that the step
    after a sequence stops still carries its row (a larger batch bucket may round other rows
    differently, as any change of batch does).
    ``prefill_graphs`` (default None: on with the decode CUDA graphs on one GPU, off under
    tensor / expert parallelism, whose GPU run is pending): prefill and mixed steps of up to
    ``max_num_batched_tokens`` tokens (at most 1,024: larger steps are GPU-bound and run
    eagerly) run as piecewise CUDA graphs of bucketed token counts
    (``dsv4.engine.prefill_graphs``): each layer's token-local ops (projections, mHC, MoE)
    replay from graphs and only the attention's cache part runs eagerly, so short prompts no
    longer wait on the host issuing every launch; captured with the decode graphs (20–50 s
    and ~2 GB for 43 layers on a fresh machine; under tensor / expert parallelism on every
    rank, with ``cuda_graphs_under_tp``).
    ``moe_fp8_codes`` (default False; MXFP4 experts under ``numerics="official"``, whose large
    prefill steps run the FP8-MMA expert path): keep an FP8 re-encoding of the routed experts on
    the GPU next to them (lossless; about twice the MXFP4 stacks' bytes, counted as weights in the
    cache sizing), so prefill steps large enough for the FP8-MMA expert GEMMs skip re-encoding
    every expert of every MoE layer at each step (``dsv4.ops.triton_moe_fp8``); for machines
    with memory to spare, e.g. V4-Flash over 8 GPUs with ``expert_parallel``.
    ``warmup`` (default None: on for one GPU): before serving, run a few synthetic requests
    through the engine (a chunked long prompt next to a decoding short one, one prompt per
    prefill step size, a batch of short prompts; ``dsv4.engine.warmup``) so that the Triton
    kernels they need are compiled (or loaded from Triton's disk cache) at start instead of
    stalling the first requests for seconds; the engine is idle and its counters untouched
    afterwards.  Under tensor / expert parallelism it is off unless set (the driver then runs it
    when constructed, the workers follow from their worker loop).
    ``precompile`` (default None: on for one GPU): compile the Triton kernels of the shipped
    kernel manifest (``dsv4/ops/kernels_sm90.json``, or the file ``DSV4_KERNEL_MANIFEST`` names)
    that Triton's disk cache lacks, in worker processes while the model loads
    (``dsv4.ops.precompile``), so that a fresh machine's start does not compile them one by
    one; nothing to do on a machine that started before.  ``DSV4_RECORD_KERNELS=path`` records
    the kernels a process compiles or loads into a manifest at ``path``.
    ``model`` and ``tokenizer`` may pass already-loaded objects (tests, benchmarks);
    ``model_factory(config, parallel, device, dtype)`` builds this rank's model instead of
    loading the checkpoint's weights, after the process group exists (``bench/tp_bench.py``:
    random weights made on each GPU; ``model_path`` then needs only ``config.json``).
    """

    device: str | None = None
    dtype: str | torch.dtype | None = None
    kv_cache_dtype: str = "auto"
    numerics: str = "bf16"
    backend: str | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    page_size: int = 256
    num_pages: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    enforce_eager: bool = False
    cuda_graph_max_batch: int | None = None
    cuda_graph_capture: str = "startup"
    cuda_graphs_under_tp: bool = True
    pipeline_decode: bool | None = None
    moe_fp8_codes: bool = False
    prefill_graphs: bool | None = None
    warmup: bool | None = None
    precompile: bool | None = None
    model: Any = field(default=None, repr=False)
    model_factory: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "page_size", "max_logprobs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"engine option {name}={v!r} is invalid; allowed: an integer > 0")
        for name in ("max_model_len", "num_pages", "kv_cache_memory", "cuda_graph_max_batch"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"engine option {name}={v!r} is invalid; allowed: an integer > 0 "
                                 "or None")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"engine option enforce_eager={self.enforce_eager!r} is invalid; "
                             "allowed: True, False")
        if self.cuda_graph_capture not in ("startup", "lazy"):
            raise ValueError(f"engine option cuda_graph_capture={self.cuda_graph_capture!r} is "
                             "invalid; allowed: 'startup', 'lazy'")
        for name in ("pipeline_decode", "prefill_graphs", "warmup", "precompile"):
            v = getattr(self, name)
            if v not in (None, True, False):
                raise ValueError(f"engine option {name}={v!r} is invalid; "
                                 "allowed: None, True, False")
        if not isinstance(self.moe_fp8_codes, bool):
            raise ValueError(f"engine option moe_fp8_codes={self.moe_fp8_codes!r} is invalid; "
                             "allowed: True, False")
        if not isinstance(self.cuda_graphs_under_tp, bool):
            raise ValueError(f"engine option cuda_graphs_under_tp={self.cuda_graphs_under_tp!r} "
                             "is invalid; allowed: True, False")
        if self.model_factory is not None and (self.model is not None
                                               or not callable(self.model_factory)):
            raise ValueError("engine option model_factory must be a callable "
                             "(config, parallel, device, dtype) -> model, and excludes model=")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine option gpu_memory_utilization={self.gpu_memory_utilization!r}"
                             " is invalid; allowed: a number in (0, 1]")
        if self.kv_cache_dtype not in ("auto", "bf16", "fp8"):
            raise ValueError(f"engine option kv_cache_dtype={self.kv_cache_dtype!r} is invalid; "
                             "allowed: 'auto', 'bf16', 'fp8'")
        if self.numerics not in ("bf16", "official"):
            raise ValueError(f"engine option numerics={self.numerics!r} is invalid; allowed: "
                             "'bf16', 'official'")
        if isinstance(self.dtype, str) and self.dtype not in _DTYPES:
            raise ValueError(f"engine option dtype={self.dtype!r} is invalid; allowed: "
                             f"{sorted(_DTYPES)}")
        self.parallel_config()  # validates tensor_parallel_size / expert_parallel

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.expert_parallel)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineOptions":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype


class _Request:
    """Engine-side state of one request: its sequences and what has been reported."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, seqs: list[Sequence], detoks: list[IncrementalDetokenizer],
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = seqs
        self.detoks = detoks
        self.logprobs: list[list[PositionLogprobs] | None] = [
            [] if params.logprobs is not None else None for _ in seqs]
        self.cumulative: list[float | None] = [
            0.0 if params.logprobs is not None else None for _ in seqs]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        outs = []
        for seq, det, lps, cum in zip(self.seqs, self.detoks, self.logprobs, self.cumulative):
            outs.append(CompletionOutput(
                index=seq.index, text=det.visible_text(seq.is_finished),
                token_ids=seq.output_token_ids, cumulative_logprob=cum,
                logprobs=list(lps) if lps is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_ids,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            outputs=outs, finished=self.finished, metrics=dataclasses.replace(self.metrics))


def _locked(method: Callable) -> Callable:
    """Run an engine method under the engine's lock."""
    @functools.wraps(method)
    def wrapper(self: "LLMEngine", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def prefill_graphs_on(option: bool | None, decode_graphs: bool, parallel: bool) -> bool:
    """The engine option ``prefill_graphs`` resolved: an explicit True / False as given; the
    default (None) on where decode CUDA graphs are on and the model runs on one GPU (measured
    there: 2.8x faster 128-token prefills over 43 layers), off under tensor / expert parallelism
    until a two-GPU run checks it."""
    if option is None:
        return decode_graphs and not parallel
    return option


class LLMEngine:
    """The serving core: scheduler + cache manager + model runner + detokenization.

    Args:
        model_path: checkpoint directory (config.json, safetensors, tokenizer).
        **engine_options: see :class:`EngineOptions`.
    """

    def __init__(self, model_path: str, **engine_options: Any) -> None:
        opts = EngineOptions.from_kwargs(**engine_options)
        self.options = opts
        kernels_loaded()   # installs the counter before anything compiles
        self.model_path = model_path
        device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("engine option device='cuda' but CUDA is not available")
        dtype = opts.torch_dtype(device)
        cache_dtype = resolve_cache_dtype(opts.kv_cache_dtype, dtype, device)
        self.config: ModelConfig = ModelConfig.from_file(model_path)
        cfg = self.config
        pconf = opts.parallel_config()
        pconf.check_model(cfg)  # before any process group or weight
        self.parallel: Parallel = init_parallel(pconf, device)
        if self.parallel.enabled and device.type == "cuda":
            device = torch.device("cuda", self.parallel.local_rank)  # one GPU per process
        self.device = device
        max_model_len = opts.max_model_len or min(cfg.max_position_embeddings, 8192)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.max_model_len = max_model_len

        self.precompile_stats: dict[str, Any] | None = None
        precompiling = self._start_precompile(device)
        try:
            self._load_tokenizer_and_model(model_path, device, dtype)
        except BaseException:
            if precompiling is not None:
                precompiling.cancel()   # no compile workers outliving a failed start
            raise
        if precompiling is not None:
            # Before the first kernel launch (decode weight forms, profiling, captures).
            self.precompile_stats = precompiling.wait()

        if device.type == "cuda" and hasattr(self.model, "prepare_decode_weights"):
            # Decode-only weight forms count as weights in the cache sizing below.
            extra_bytes = self.model.prepare_decode_weights()
            if extra_bytes:
                log.info("dsv4 engine: %.2f GiB of decode-only weight forms", extra_bytes / 2**30)
        if device.type == "cuda" and opts.moe_fp8_codes:
            if not hasattr(self.model, "keep_expert_fp8_codes"):
                raise ValueError("engine option moe_fp8_codes=True: this model has no MXFP4 "
                                 "expert stacks to re-encode")
            try:
                kept = self.model.keep_expert_fp8_codes()
            except torch.cuda.OutOfMemoryError as e:
                raise ValueError("engine option moe_fp8_codes=True: the FP8 copies of the "
                                 "routed experts do not fit on this GPU next to the weights; "
                                 "turn it off or use more GPUs (expert_parallel)") from e
            if kept:
                log.info("dsv4 engine: %.2f GiB of kept FP8 expert codes", kept / 2**30)
            else:
                log.warning("dsv4 engine: moe_fp8_codes=True kept nothing: it needs MXFP4 "
                            "experts under numerics='official' (the FP8-MMA prefill path)")
        profile = graph_pool = None
        use_graphs = device.type == "cuda" and not opts.enforce_eager and (
            not self.parallel.enabled or opts.cuda_graphs_under_tp)
        graph_batch = opts.cuda_graph_max_batch or opts.max_num_seqs
        prefill_tokens = min(opts.max_num_batched_tokens, max_model_len)
        prefill_graphs = prefill_graphs_on(opts.prefill_graphs, use_graphs,
                                           self.parallel.enabled)
        prefill_pool = prefill_graphs and use_graphs
        if use_graphs or prefill_pool:
            def graph_pool() -> int:
                total = 0
                if use_graphs:
                    total += profile_decode_graph_bytes(
                        self.model, cfg, device=device, cache_dtype=cache_dtype,
                        page_size=opts.page_size, max_model_len=max_model_len,
                        max_batch=graph_batch)
                if prefill_pool:
                    # The segments' pool and buffers: bounded by an eager step's peak at the
                    # largest bucket (its activations, which the segments hold at most once).
                    total += profile_peak_bytes(
                        self.model, cfg, device=device, cache_dtype=cache_dtype,
                        page_size=opts.page_size,
                        num_tokens=min(prefill_tokens, ENGINE_MAX_TOKENS),
                        num_logits=opts.max_num_seqs)
                return total
        if device.type == "cuda":
            def profile() -> int:
                return profile_peak_bytes(
                    self.model, cfg, device=device, cache_dtype=cache_dtype,
                    page_size=opts.page_size,
                    num_tokens=min(opts.max_num_batched_tokens, max_model_len),
                    num_logits=opts.max_num_seqs)
        num_pages = size_cache(
            cfg, device=device, cache_dtype=cache_dtype, page_size=opts.page_size,
            num_slots=opts.max_num_seqs, max_model_len=max_model_len,
            max_num_seqs=opts.max_num_seqs, num_pages=opts.num_pages,
            kv_cache_memory=opts.kv_cache_memory,
            gpu_memory_utilization=opts.gpu_memory_utilization, profile=profile,
            graph_pool=graph_pool)
        # Every rank holds the same page ids: the smallest count any rank can afford.
        num_pages = self.parallel.min_int(num_pages)
        self.manager = CacheManager(num_pages, opts.page_size, opts.max_num_seqs)
        self.scheduler = Scheduler(self.manager, opts.max_num_batched_tokens, opts.max_num_seqs,
                                   max_model_len)
        self.runner = ModelRunner(self.model, cfg, device=device, cache_dtype=cache_dtype,
                                  num_pages=num_pages, num_slots=opts.max_num_seqs,
                                  page_size=opts.page_size, seed=opts.seed,
                                  parallel=self.parallel, max_model_len=max_model_len,
                                  enforce_eager=opts.enforce_eager,
                                  cuda_graph_max_batch=graph_batch,
                                  graphs_under_tp=opts.cuda_graphs_under_tp,
                                  prefill_graphs=prefill_graphs,
                                  prefill_max_tokens=prefill_tokens)
        if opts.cuda_graph_capture == "startup":
            # Every rank captures here, in the same order (the graphs hold the collectives).
            self.runner.capture_graphs()
        self.eos_token_id = cfg.eos_token_id
        self.pipeline_decode = use_graphs if opts.pipeline_decode is None else opts.pipeline_decode
        self._inflight: InFlight | None = None   # a launched decode step not yet collected
        self._pipelined_launches = 0
        self._token_text = TokenTextCache(self.tokenizer)
        self._requests: dict[str, _Request] = {}
        # add/abort may come from other threads than the one calling step(); they wait for the
        # step to end instead of changing queues under it.
        self._lock = threading.RLock()
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0,
                        "requests_aborted": 0, "steps": 0}
        log.info("dsv4 engine: %d pages x %d tokens, %d slots, max_model_len %d, cache %s",
                 num_pages, opts.page_size, opts.max_num_seqs, max_model_len,
                 "fp8 records" if cache_dtype == RECORD_DTYPE else cache_dtype)
        self._shut_down = False
        if self.parallel.enabled and self.parallel.is_driver:
            # A script that never calls shutdown() must not leave the workers waiting forever.
            atexit.register(self.shutdown)
        self.warmup_stats: dict[str, Any] | None = None
        warm = (device.type == "cuda" and not self.parallel.enabled
                if opts.warmup is None else opts.warmup)
        if warm and self.is_driver:
            self.warmup_stats = run_warmup(self)
        if _recorder is not None:
            _recorder.write(os.environ["DSV4_RECORD_KERNELS"])

    def _load_tokenizer_and_model(self, model_path: str, device: torch.device,
                                  dtype: torch.dtype) -> None:
        """The tokenizer and this rank's model: as passed, built by ``model_factory``, or
        loaded from the checkpoint."""
        opts = self.options
        if opts.tokenizer is not None:
            self.tokenizer = opts.tokenizer
        else:
            from dsv4.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(model_path)
        if opts.model is not None:
            self.model = opts.model
        elif opts.model_factory is not None:
            self.model = opts.model_factory(self.config, self.parallel, device, dtype)
        else:
            from dsv4.model.transformer import load_model
            backend = opts.backend or ("torch" if device.type == "cpu" else "triton")
            extra = {"parallel": self.parallel} if self.parallel.enabled else {}
            self.model = load_model(model_path, device=device, dtype=dtype,
                                    numerics=opts.numerics, backend=backend, **extra)

    def _start_precompile(self, device: torch.device) -> Any:
        """Start compiling the kernel manifest's missing kernels (engine option ``precompile``),
        and recording where ``DSV4_RECORD_KERNELS`` says; returns the running job or None."""
        global _recorder
        if device.type != "cuda":
            return None
        from dsv4.ops import precompile

        if os.environ.get("DSV4_RECORD_KERNELS") and _recorder is None:
            _recorder = precompile.record_to(os.environ["DSV4_RECORD_KERNELS"])
        if _recorder is not None:
            _recorder.dims.add(self.config.dim)
        on = (not self.parallel.enabled if self.options.precompile is None
              else self.options.precompile)
        if not on:
            return None
        major, minor = torch.cuda.get_device_capability(device)
        manifest = os.environ.get("DSV4_KERNEL_MANIFEST") or precompile.SHIPPED_MANIFEST
        # Every rank of a host shares the disk cache: each compiles with its share of the CPUs.
        workers = max(1, precompile.default_workers() // max(1, self.parallel.world_size))
        try:
            return precompile.start(manifest, 10 * major + minor, workers=workers,
                                    dim=self.config.dim)
        except Exception as e:   # an optimization only: the kernels then compile on first use
            log.warning("dsv4 engine: kernel precompile not started (%s: %s)",
                        type(e).__name__, e)
            return None

    # ------------------------------------------------------------------ parallel launch
    @property
    def is_driver(self) -> bool:
        """True on the process that schedules and samples (always, without parallelism)."""
        return self.parallel.is_driver

    def run_worker(self) -> int:
        """Ranks > 0: run the driver's steps until it shuts down (returns the steps run), then
        leave the process group."""
        from dsv4.dist.worker import run_worker

        try:
            steps = run_worker(self.runner)
            self.parallel.barrier()
        finally:
            self._shut_down = True
            self.parallel.close()
        return steps

    @_locked
    def shutdown(self) -> None:
        """Driver: release the workers (their ``run_worker`` returns) and leave the process
        group.  Idempotent; a no-op without parallelism and on workers."""
        if self._shut_down or not self.parallel.enabled or not self.parallel.is_driver:
            return
        from dsv4.dist.worker import stop_workers

        self._shut_down = True
        atexit.unregister(self.shutdown)
        try:
            stop_workers(self.parallel)
            self.parallel.barrier()
        except Exception as e:  # noqa: BLE001 - e.g. torchrun already stopped the workers
            log.warning("dsv4 engine: could not stop the workers cleanly: %s", e)
        finally:
            self.parallel.close()

    # ------------------------------------------------------------------ requests
    @_locked
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, token_types: list[int] | None = None,
                    arrival_time: float | None = None, prompt_text: str | None = None) -> None:
        """Queue a request.  ``prompt`` is text (tokenized here) or token ids.

        ``prompt_text`` is the text of a prompt given as ids, reported back in the outputs.

        Raises ValueError for a duplicate id, an empty prompt, token ids outside the vocabulary,
        a prompt longer than max_model_len, too many logprobs, or bad token_types.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        text: str | None = prompt_text
        if isinstance(prompt, str):
            text = prompt
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("prompt must be a string or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the "
                             f"vocabulary 0..{vocab - 1}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"request {request_id!r}: the prompt has {len(ids)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.options.max_logprobs:
                raise ValueError(f"request {request_id!r}: {name}={k} exceeds the engine's "
                                 f"max_logprobs={self.options.max_logprobs}")
        if token_types is not None:
            if not self.config.is_v41:
                raise ValueError("token_types (image marks) are a V4.1 input; this model is "
                                 f"{self.config.variant}")
            if len(token_types) != len(ids):
                raise ValueError(f"request {request_id!r}: token_types has {len(token_types)} "
                                 f"entries for {len(ids)} prompt tokens")
        arrival = self.scheduler.next_arrival()
        seqs = [Sequence(request_id, i, ids, params, arrival,
                         token_types=list(token_types) if token_types is not None else None)
                for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params) for _ in seqs]
        req = _Request(request_id, text, ids, params, seqs, detoks,
                       time.monotonic() if arrival_time is None else arrival_time)
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request_id] = req
        self._totals["prompt_tokens"] += len(ids)

    @_locked
    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their cache is freed now."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.abort(rid)
            for seq in req.seqs:
                self.runner.release(seq.key)
            self._totals["requests_aborted"] += 1
        self._park_if_idle()

    def _park_if_idle(self) -> None:
        """With no request left, send the parallel workers back to the control group: a server
        may now stay idle for longer than a collective may wait (dsv4.dist.parallel)."""
        if not self._requests and self.parallel.enabled and not self._shut_down:
            self.parallel.park()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ one step
    @_locked
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that produced a token or finished in it."""
        if not self.is_driver:
            raise RuntimeError(f"LLMEngine.step: this process is {self.parallel.describe()}; only "
                               "rank 0 runs the engine (the others call run_worker())")
        if self._shut_down:
            raise RuntimeError("LLMEngine.step: the engine was shut down (its workers are gone)")
        try:
            return self._step()
        finally:
            self._park_if_idle()

    def _step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            return self._pipelined_step(self._inflight)
        with record_function("dsv4.schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            return []
        if self.pipeline_decode and self.runner.pipelinable(out):
            self._note_scheduled(out)
            try:
                step = self.runner.launch(out)
            except Exception:
                self._fail_step(out)
                raise
            return self._pipelined_step(step)
        self._note_scheduled(out)
        try:
            result = self.runner.execute(out)
        except torch.OutOfMemoryError:
            # Out of device memory (activations of a large step): retry these sequences later in
            # smaller steps.  Under tensor parallelism the ranks could disagree on who failed, so
            # there it is an error like any other.
            already = len(out.preempted)
            if self.parallel.enabled or not self.scheduler.on_out_of_memory(out):
                self._fail_step(out)
                raise
            log.warning("dsv4 engine: a step of %d tokens ran out of device memory; its %d "
                        "sequences are preempted and steps are limited to %d tokens for now",
                        out.num_batched_tokens, len(out.scheduled), self.scheduler.oom_budget)
            for seq in out.preempted[already:]:
                self._requests[seq.request_id].metrics.num_preemptions += 1
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return []
        except Exception:
            # The step may have written part of these requests' cache state: drop them (their
            # pages and slots come back) so nothing half-written is ever read again.  Other
            # requests are untouched; the caller sees the error.
            self._fail_step(out)
            raise
        with record_function("dsv4.process_outputs"):
            self.scheduler.note_step_done()
            self.scheduler.update(out, result.sampled, self.eos_token_id)
            self._totals["steps"] += 1
            return self._process(out, result)

    def _note_scheduled(self, out: Any) -> None:
        now = time.monotonic()
        for s in out.scheduled:
            req = self._requests[s.seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        for seq in out.preempted:
            self._requests[seq.request_id].metrics.num_preemptions += 1

    def _pipelined_step(self, step: InFlight) -> list[RequestOutput]:
        """Collect the in-flight decode step ``step``, after launching the next one of the same
        sequences when it can be (:meth:`_speculate`): the device runs it while the host reads
        ``step``'s samples and makes its outputs."""
        self._inflight = None
        nxt_out = self._speculate(step.out)
        nxt = None
        if nxt_out is not None:
            try:
                nxt = self.runner.launch(nxt_out, after=step)
            except Exception:
                self._fail_step(step.out)
                raise
            self._pipelined_launches += 1
        result = self.runner.collect(step)
        with record_function("dsv4.process_outputs"):
            self.scheduler.note_step_done()
            self.scheduler.update(step.out, result.sampled, self.eos_token_id)
            self._totals["steps"] += 1
            outputs = self._process(step.out, result)
        if nxt is not None and any(s.seq.status is SequenceStatus.RUNNING
                                   for s in nxt.out.scheduled):
            self._inflight = nxt
        # (else every sequence of nxt stopped: its results are dropped unread; the device
        # finishes it before any later step, in stream order, so the pages and slots its
        # sequences freed are safe to reuse.)
        return outputs

    def _speculate(self, out: Any) -> Any:
        """The pipelined step after the in-flight ``out`` (:meth:`Scheduler.next_decode`), or
        None when there is none or it cannot run pipelined."""
        spec = self.scheduler.next_decode(out)
        return spec if spec is not None and self.runner.pipelinable(spec) else None

    def _fail_step(self, out: Any) -> None:
        failed = dict.fromkeys(s.seq.request_id for s in out.scheduled)
        log.exception("dsv4 engine: step failed; aborting requests %s", list(failed))
        self.abort_request(list(failed))

    def _process(self, out: Any, result: StepResult) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for s in out.scheduled:
            seq = s.seq
            req = self._requests.get(seq.request_id)
            if req is None:
                continue   # finished or aborted while a pipelined step ran
            for pos, info in result.prompt_logprobs.get(seq.key, ()):
                if pos == len(req.prompt_logprobs):  # a recompute does not add them twice
                    req.prompt_logprobs.append(self._logprob_dict(info))
                    seq.prompt_logprobs_next = pos + 1
            if seq.key not in result.sampled:
                continue
            token = result.sampled[seq.key]
            self._totals["generation_tokens"] += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            lp = result.logprobs.get(seq.key)
            if lp is not None:
                req.logprobs[seq.index].append(self._logprob_dict(lp))
                req.cumulative[seq.index] += lp.token[1]
            # An eos / stop token that ended the sequence adds no text (vLLM semantics).
            ended_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
            det = req.detoks[seq.index]
            hit = det.add_token(token, suppress_text=ended_by_token
                                and not seq.params.include_stop_str_in_output)
            if hit is None and seq.is_finished:
                hit = det.flush()
            if hit is not None:
                if seq.is_finished:  # finished by length on the same token: the stop wins
                    seq.finish_reason, seq.stop_reason = "stop", hit
                else:
                    self.scheduler.finish(seq, "stop", hit)
            touched[req.request_id] = req

        outputs = []
        for req in touched.values():
            if req.finished:
                req.metrics.finished_time = now
                self._requests.pop(req.request_id, None)
                for seq in req.seqs:
                    self.runner.release(seq.key)
                self._totals["requests_finished"] += 1
            outputs.append(req.output())
        return outputs

    def _logprob_dict(self, info: RowLogprobs) -> PositionLogprobs:
        out: PositionLogprobs = {}
        for tok, lp, rank in info.top:
            out[tok] = Logprob(lp, rank, self._token_text(tok))
        tok, lp, rank = info.token
        if tok not in out:
            out[tok] = Logprob(lp, rank, self._token_text(tok))
        return out

    # ------------------------------------------------------------------ introspection
    @_locked
    def get_stats(self) -> dict[str, Any]:
        """Queue lengths, cache usage and token totals."""
        sched = self.scheduler
        # Requests (as vLLM counts them); a request with n > 1 runs n sequences.
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        return {
            "num_running": len(running),
            "num_waiting": len(waiting),
            "num_running_seqs": sched.num_running,
            "num_waiting_seqs": sched.num_waiting,
            "num_unfinished_requests": len(self._requests),
            "cache_usage": self.manager.usage,
            "num_pages": self.manager.num_pages,
            "num_free_pages": self.manager.num_free_pages,
            "page_size": self.manager.page_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self._totals["prompt_tokens"],
            "generation_tokens_total": self._totals["generation_tokens"],
            "requests_finished_total": self._totals["requests_finished"],
            "requests_aborted_total": self._totals["requests_aborted"],
            "steps_total": self._totals["steps"],
            # Compiles while serving stall steps for seconds; after the warm-up this stays put.
            "triton_kernels_loaded_total": kernels_loaded(),
        }

    @_locked
    def check_idle(self) -> None:
        """Raise RuntimeError unless no request is left and every page and slot is free."""
        if self._requests or self.scheduler.has_unfinished():
            raise RuntimeError(f"engine not idle: {len(self._requests)} unfinished request(s) "
                               f"({list(self._requests)[:5]}), {self.scheduler.num_running} "
                               f"running, {self.scheduler.num_waiting} waiting")
        self.manager.check_idle()
