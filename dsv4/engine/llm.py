"""``dsv4.LLM``: offline batched generation (vLLM's ``LLM`` API, the parts that matter here).

>>> from dsv4 import LLM, SamplingParams
>>> llm = LLM()                       # the embedded tiny checkpoint on CPU
>>> outs = llm.generate(["Hello"], SamplingParams(max_tokens=8), use_tqdm=False)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.sampling_params import RequestOutput, SamplingParams

PromptLike = str | list[int] | dict


def default_model_path() -> str:
    """The embedded tiny V4 checkpoint (generated once into a cache directory)."""
    from dsv4.tiny import default_checkpoint

    return default_checkpoint()


class LLM:
    """Load a checkpoint and generate from batches of prompts.

    Args:
        model: checkpoint directory; None uses the embedded tiny V4 checkpoint.
        tensor_parallel_size: processes (one GPU each) sharing the model, default 1.  Launch
            the script with ``torchrun --nproc-per-node N`` (``--nnodes`` for several hosts):
            every rank constructs the LLM; rank 0 (``is_driver``) generates, while on the other
            ranks the constructor runs the worker loop and returns only when rank 0 calls
            :meth:`shutdown` (or exits).
        expert_parallel: split the routed experts by expert over the ranks instead of splitting
            each expert's intermediate dim (default False).
        device, dtype, kv_cache_dtype, max_num_batched_tokens, max_num_seqs, max_model_len,
        seed, **engine_options: passed to :class:`LLMEngine` (see ``EngineOptions``).

    A script for one or several GPUs::

        llm = LLM(path, tensor_parallel_size=2)   # ranks > 0 return from here at shutdown
        if llm.is_driver:
            print(llm.generate(["Hello"])[0].outputs[0].text)
        llm.shutdown()
    """

    def __init__(self, model: str | None = None, *, tensor_parallel_size: int = 1,
                 expert_parallel: bool = False, device: str | None = None,
                 dtype: Any = None, kv_cache_dtype: str = "auto",
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64,
                 max_model_len: int | None = None, seed: int = 0, **engine_options: Any) -> None:
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_path = model or default_model_path()
        self.engine = LLMEngine(self.model_path, device=device, dtype=dtype,
                                kv_cache_dtype=kv_cache_dtype,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                seed=seed, tensor_parallel_size=tensor_parallel_size,
                                expert_parallel=expert_parallel, **engine_options)
        self._ids = itertools.count()
        if not self.engine.is_driver:
            self.engine.run_worker()

    @property
    def is_driver(self) -> bool:
        """True on the process that generates (rank 0; always without parallelism)."""
        return self.engine.is_driver

    def shutdown(self) -> None:
        """Rank 0 of a parallel launch: release the workers (their constructors return) and
        leave the process group.  Idempotent; a no-op otherwise."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list of prompts; outputs come back in input order.

        A prompt is a string, a list of token ids, or ``{"prompt": str}`` /
        ``{"prompt_token_ids": [...]}`` (optionally with ``"token_types"`` for V4.1).
        ``sampling_params`` is one SamplingParams for all, or one per prompt.
        """
        items = self._normalize_prompts(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"generate: {len(params)} sampling_params for {len(items)} "
                                 "prompts; pass one, or one per prompt")
        return self._run(items, params, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, **chat_template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of message dicts) or to a list of
        conversations, rendered with the model's chat format (``dsv4.chat.encoding``).

        ``chat_template_kwargs`` go to ``encode_messages`` (thinking, reasoning_effort, tools).
        """
        from dsv4.chat.encoding import encode_messages  # the server engineer's module

        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("chat: messages must be a non-empty list of message dicts (or a list "
                             "of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        items = []
        for conv in conversations:
            text = encode_messages(conv, variant=self.engine.config.variant,
                                   **chat_template_kwargs)
            # The rendered text already starts with BOS: add no special tokens again.
            items.append({"prompt": text,
                          "prompt_token_ids": list(tok.encode(text, add_special_tokens=False))})
        return self.generate(items, sampling_params, use_tqdm)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[dict]:
        def one(p: Any, i: int) -> dict:
            if isinstance(p, str):
                return {"prompt": p}
            if isinstance(p, dict):
                if "prompt_token_ids" not in p and "prompt" not in p:
                    raise ValueError(f"generate: prompt {i} is a dict without 'prompt' or "
                                     "'prompt_token_ids'")
                return p
            if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                return {"prompt_token_ids": list(p)}
            raise ValueError(f"generate: prompt {i} is a {type(p).__name__}; expected a string, "
                             "a list of token ids or a dict")

        if isinstance(prompts, (str, dict)):
            return [one(prompts, 0)]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) for t in prompts):
                return [one(prompts, 0)]  # a single tokenized prompt
            return [one(p, i) for i, p in enumerate(prompts)]
        raise ValueError(f"generate: prompts must be a string, a dict or a list; got "
                         f"{type(prompts).__name__}")

    def _run(self, items: list[dict], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        if not engine.is_driver:
            raise RuntimeError("LLM.generate: only rank 0 of a tensor parallel launch generates; "
                               "this worker's LLM returned because rank 0 shut down (guard the "
                               "call with `if llm.is_driver:`)")
        ids: list[str] = []
        try:
            for item, p in zip(items, params):
                rid = f"llm-{next(self._ids)}"
                prompt = item["prompt_token_ids"] if "prompt_token_ids" in item else item["prompt"]
                engine.add_request(rid, prompt, p, token_types=item.get("token_types"),
                                   prompt_text=item.get("prompt"))
                ids.append(rid)
            done: dict[str, RequestOutput] = {}
            bar = _progress(len(ids)) if use_tqdm else None
            while len(done) < len(ids):
                if not engine.has_unfinished_requests():
                    raise RuntimeError("generate: the engine stopped with requests unanswered: "
                                       f"{sorted(set(ids) - set(done))[:5]}")
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            engine.abort_request(ids)
            raise
        return [done[rid] for rid in ids]


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
