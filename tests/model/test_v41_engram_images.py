"""V4.1 Engram and image marks in the full model (spec §4.7–4.9), the tokenizer's token map at
load, the DSpark stages (loaded, validated, not run) and bad inputs."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import expected_tensors, load_checkpoint
from dsv4.model.transformer import Transformer, load_model
from test_v41_helpers import new_cache, prompt, run_chunks, v41_checkpoint, v41_model

TOL = dict(rtol=0, atol=3e-5)
SPAN_TYPES = [0, 1, 1, 2, 1, 3]   # IMAGE_START, IMAGE ×2, NEW_LINE, IMAGE, IMAGE_END


pytestmark = pytest.mark.usefixtures("one_thread")


def _image_prompt(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """5 text tokens, an image span of 6 positions (all the image token id), 9 text tokens.
    Returns (ids, token_types, the 9 trailing text ids)."""
    head, tail = prompt(21, 5), prompt(22, 9)
    image = torch.full((len(SPAN_TYPES),), model.cfg.image_token_id, dtype=torch.int64)
    ids = torch.cat((head, image, tail))
    types = torch.tensor([-1] * 5 + SPAN_TYPES + [-1] * 9)
    return ids, types, tail


class _EngramTap:
    """Records (x_in, row_ids, token_mask, x_out) of one Engram layer's calls."""

    def __init__(self, model, layer: int) -> None:
        self.calls: list[tuple] = []
        self.hook = model.layers[layer].engram.register_forward_hook(
            lambda m, inp, out: self.calls.append((inp[0].clone(), inp[1].clone(),
                                                   None if inp[2] is None else inp[2].clone(),
                                                   out.clone())))

    def cat(self, i: int) -> torch.Tensor:
        return torch.cat([c[i] for c in self.calls])

    def remove(self) -> None:
        self.hook.remove()


def test_image_spans_break_ngrams_and_zero_the_gate() -> None:
    model = v41_model("bf16")
    ids, types, tail = _image_prompt(model)
    span = slice(5, 5 + len(SPAN_TYPES))
    for layer in model.cfg.engram_layer_ids:
        tap = _EngramTap(model, layer)
        try:
            model.forward_full(ids, token_types=types)
            model.forward_full(tail)
        finally:
            tap.remove()
        (x_in, rows, mask, x_out), (_, rows_alone, mask_alone, _) = tap.calls
        assert mask.tolist() == (types < 0).tolist() and mask_alone is None
        # The n-grams after the span never reach across it: the text after an image hashes as
        # if it started the sequence.
        assert torch.equal(rows[span.stop:], rows_alone)
        # ... and the text before it is hashed with its own history (not all pads).
        assert not torch.equal(rows[1:5], rows_alone[1:5])
        # Image tokens: every n-gram is all pads (a DEAD token blocks itself), gate 0.
        assert (rows[span] == rows[span][:1]).all()
        assert torch.equal(x_out[span], x_in[span])
        assert (x_out[:5] - x_in[:5]).abs().amax(dim=(1, 2)).min() > 0


def test_image_prompt_chunked_equals_full() -> None:
    """Chunks that split the image span: the Engram lookback carries DEAD across steps."""
    model = v41_model("bf16")
    ids, types, _ = _image_prompt(model)
    ref = model.forward_full(ids, token_types=types)
    for sizes in ([4], [1], [7, 2]):
        out = run_chunks(model, ids, sizes, token_types=types)
        torch.testing.assert_close(out, ref, **TOL)
    # The marks matter: the same ids read as text give other logits after the span.
    plain = model.forward_full(ids)
    assert (plain[5:] - ref[5:]).abs().max() > 1e-3
    torch.testing.assert_close(plain[:5], ref[:5], **TOL)   # (expert batches differ: rounding)


def test_bias_vl_steers_only_image_tokens() -> None:
    model = load_model(v41_checkpoint(), dtype=torch.float32)   # its own copy: mutated below
    ids, types, tail = _image_prompt(model)
    image = types >= 0
    routes: list[torch.Tensor] = []
    hook = model.layers[0].ffn.gate.register_forward_hook(
        lambda m, inp, out: routes.append(out[1].clone()))
    try:
        before = model.forward_full(ids, token_types=types)
        text_before = model.forward_full(tail)
        with torch.no_grad():
            for layer in model.layers:
                layer.ffn.gate.bias_vl.zero_()
                layer.ffn.gate.bias_vl[[0, 1]] = 100.0   # pull image tokens to experts 0, 1
        after = model.forward_full(ids, token_types=types)
        text_after = model.forward_full(tail)
    finally:
        hook.remove()
    r_before, r_after = routes[0], routes[2]
    assert torch.equal(r_before[~image], r_after[~image])
    assert (r_after[image].sort(-1).values == torch.tensor([0, 1])).all()
    assert not (r_before[image].sort(-1).values == torch.tensor([0, 1])).all()
    torch.testing.assert_close(after[:5], before[:5], **TOL)   # causal: the text before
    assert (after[5:] - before[5:]).abs().max() > 1e-3
    torch.testing.assert_close(text_after, text_before, rtol=0, atol=0)   # no image: unused


def test_token_map_size_must_match_the_config(tmp_path: Path) -> None:
    src = Path(v41_checkpoint())
    cfg_json = json.loads((src / "config.json").read_text())
    real = cfg_json["text_config"]["engram_compressed_vocab_size"]
    cfg_json["text_config"]["engram_compressed_vocab_size"] = real + 1
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ValueError, match=rf"compressed vocabulary of {real} ids; config "
                                         rf"engram_compressed_vocab_size is {real + 1}"):
        load_model(str(tmp_path), dtype=torch.float32)


def test_forward_needs_the_token_map() -> None:
    model = v41_model("bf16")
    bare = Transformer(model.cfg, dtype=torch.float32)
    with pytest.raises(ValueError, match="Engram token map is not set"):
        bare.forward_full([5, 6, 7])
    token_map = model.engram_hasher.token_map.tolist()
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        bare.set_engram_token_map(token_map, model.cfg.engram_compressed_vocab_size - 1)
    bare.set_engram_token_map(token_map, model.cfg.engram_compressed_vocab_size)
    bare.load_state_dict(model.state_dict())
    torch.testing.assert_close(bare.forward_full([5, 6, 7]), model.forward_full([5, 6, 7]),
                               rtol=0, atol=0)


def test_dspark_stages_are_loaded_validated_not_run(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dsv4"):
        model = load_model(v41_checkpoint(), dtype=torch.float32)
    assert sum("DSpark" in r.getMessage() for r in caplog.records) == 1
    cfg = model.cfg
    assert set(model.load_targets()) == set(expected_tensors(cfg))
    assert not hasattr(model, "hc_head")
    assert len(model.mtp) == cfg.n_mtp_layers == 2
    tensors = load_checkpoint(v41_checkpoint(), dtype=torch.float32, progress=False)
    stage0, last = model.mtp[0], model.mtp[-1]
    assert stage0.ffn.experts.w1.shape[0] == cfg.dspark_n_routed_experts
    assert stage0.ffn.gate.top_k == cfg.dspark_n_activated_experts
    torch.testing.assert_close(stage0.main_proj.weight, tensors["mtp.0.main_proj.weight"])
    torch.testing.assert_close(last.markov_head.embed.weight,
                               tensors["mtp.1.markov_head.embed.weight"])
    torch.testing.assert_close(stage0.ffn.gate.bias_vl, tensors["mtp.0.ffn.gate.bias_vl"])
    with pytest.raises(NotImplementedError, match="DSpark"):
        stage0(torch.zeros(1, cfg.hc_mult, cfg.dim), None, None, None)


def test_bad_token_types() -> None:
    model = v41_model("bf16")
    with pytest.raises(ValueError, match="token_types has shape"):
        model.forward_full([5, 6, 7], token_types=[-1, -1])
    cache = new_cache(model)
    assert cache.engram_lookback is not None and (cache.engram_lookback == -1).all()
