"""dsv4.LLM and LLMEngine input validation."""

from __future__ import annotations

import pytest
import torch

from dsv4.engine.llm import LLM
from dsv4.engine.llm_engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_v4_path):
    llm = LLM(tiny_v4_path, device="cpu", max_model_len=256)
    yield llm
    llm.engine.check_idle()


def test_generate_accepts_every_prompt_form_in_input_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("The town was quiet")
    params = [GREEDY.clone(max_tokens=m) for m in (6, 1, 3, 2)]
    outs = llm.generate(["Once upon a time", "The town was quiet", {"prompt_token_ids": ids},
                         {"prompt": "Hello"}], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 1, 3, 2]
    assert outs[0].prompt == "Once upon a time"
    assert outs[0].prompt_token_ids == tok.encode("Once upon a time")
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids == ids
    # The same prompt gives the same greedy tokens however it was given.
    assert outs[2].outputs[0].token_ids[:1] == outs[1].outputs[0].token_ids
    single = llm.generate("Once upon a time", GREEDY.clone(max_tokens=6), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    by_ids = llm.generate(ids, GREEDY, use_tqdm=True)
    assert len(by_ids) == 1 and by_ids[0].prompt is None
    llm.engine.check_idle()


def test_generate_errors_leave_the_engine_clean(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1 is a float"):
        llm.generate(["a", 1.5], use_tqdm=False)
    with pytest.raises(ValueError, match="more than max_model_len=256"):
        llm.generate(["ok", {"prompt_token_ids": [5] * 300}], use_tqdm=False)
    llm.engine.check_idle()  # the first, valid prompt was aborted


def test_chat_uses_the_model_chat_format(llm: LLM) -> None:
    from dsv4.chat.encoding import encode_messages

    messages = [{"role": "user", "content": "Hello there"}]
    outs = llm.chat(messages, GREEDY, use_tqdm=False)
    text = encode_messages(messages, variant="v4")
    assert outs[0].prompt == text
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert outs[0].prompt_token_ids[0] == 0  # BOS once
    assert len(llm.chat([messages, messages], GREEDY, use_tqdm=False)) == 2


def test_engine_rejects_bad_requests(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer) -> None:
    eng = LLMEngine(tiny_v4_path, device="cpu", model=tiny_v4_model, tokenizer=tiny_v4_tokenizer,
                    max_model_len=64)
    cases = [
        (("a", ""), "prompt is empty"),
        (("a", []), "prompt is empty"),
        (("a", [5] * 65), "65 tokens, more than max_model_len=64"),
        (("a", [5, 10**6]), r"token ids \[1000000\] are outside the vocabulary"),
        (("a", [5], SamplingParams(logprobs=21)), "logprobs=21 exceeds the engine's max_logprobs=20"),
        (("a", [5], None, [-1]), "token_types .* V4.1 input"),
        (("", [5]), "request_id must be a non-empty string"),
        (("a", 5), "prompt must be a string or a list of token ids"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            eng.add_request(*args)
    eng.add_request("a", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="'a' is already in use"):
        eng.add_request("a", [5])
    eng.abort_request("a")
    eng.check_idle()


@pytest.mark.parametrize("kw, msg", [
    (dict(kv_cache_dtype="bf16"), "kv_cache_dtype='bf16' needs dtype=bfloat16"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype='int4' is invalid"),
    (dict(num_pages=1, max_model_len=512), r"1 pages .* max_model_len=512 needs 2 pages"),
    (dict(kv_cache_memory=1000), "kv_cache_memory=1000 bytes gives 0 pages"),
    (dict(max_model_len=10**7), "exceeds the model's max_position_embeddings"),
    (dict(max_num_seqs=0), "max_num_seqs=0 is invalid"),
    (dict(numerics="fp4"), "numerics='fp4' is invalid"),
    (dict(max_num_seq=4), r"unknown engine option\(s\) \['max_num_seq'\]"),
    (dict(moe_fp8_codes="yes"), "moe_fp8_codes='yes' is invalid"),
])
def test_engine_rejects_bad_options(kw, msg, tiny_v4_path, tiny_v4_model) -> None:
    with pytest.raises(ValueError, match=msg):
        LLMEngine(tiny_v4_path, device="cpu", model=tiny_v4_model, **kw)


def test_stats_count_tokens_and_usage(tiny_v4_path, tiny_v4_model, tiny_v4_tokenizer) -> None:
    eng = LLMEngine(tiny_v4_path, device="cpu", model=tiny_v4_model, tokenizer=tiny_v4_tokenizer,
                    max_model_len=128, page_size=128)
    eng.add_request("a", [5] * 10, GREEDY)
    eng.add_request("b", [6] * 3, GREEDY.clone(n=2))
    eng.step()
    stats = eng.get_stats()
    assert (stats["num_running"], stats["num_running_seqs"], stats["num_waiting"]) == (2, 3, 0)
    assert stats["cache_usage"] == pytest.approx(3 / stats["num_pages"])
    with pytest.raises(RuntimeError, match="not idle"):
        eng.check_idle()
    while eng.has_unfinished_requests():
        eng.step()
    stats = eng.get_stats()
    assert stats["prompt_tokens_total"] == 13 and stats["generation_tokens_total"] == 12
    assert stats["requests_finished_total"] == 2 and stats["cache_usage"] == 0.0
    eng.check_idle()


def test_default_model_is_the_tiny_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = LLM(device="cpu", dtype=torch.float32, max_model_len=64)
    assert llm.model_path.startswith(str(tmp_path))
    assert llm.engine.config.variant == "v4"
    assert LLM(device="cpu", max_model_len=64).model_path == llm.model_path  # generated once
    out = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_failing_step_aborts_only_its_requests(tiny_v4_path, tiny_v4_model,
                                                 tiny_v4_tokenizer) -> None:
    eng = LLMEngine(tiny_v4_path, device="cpu", model=tiny_v4_model, tokenizer=tiny_v4_tokenizer,
                    max_model_len=64, max_num_seqs=1)
    eng.add_request("bad", [5, 6, 7], GREEDY)
    eng.add_request("good", [8, 9], GREEDY)
    real = eng.runner.execute

    def explode(out):
        raise RuntimeError("device fell over")

    eng.runner.execute = explode
    with pytest.raises(RuntimeError, match="device fell over"):
        eng.step()
    eng.runner.execute = real
    assert eng.get_stats()["num_unfinished_requests"] == 1
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["good"]
    eng.check_idle()
