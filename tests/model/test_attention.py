"""sft_varlen (sftrecipes/model/attention.py): packed samples attend within themselves exactly as sdpa's block-diagonal mask
makes them, in logits and gradients, for every family shape (GQA, sliding windows, Gemma-3's scaling); padded batches
and cached generation are sdpa's; auto picks it for packed recipes where the loaded class's attention has nothing it
lacks (GPT-OSS's sinks, Gemma-2's soft-capping: eager), and an explicit kernel the class cannot run is one line."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import run_cli
from sftrecipes.model import attention
from sftrecipes.model import load as models
from sftrecipes.model import attnchoice
from sftrecipes.core.errors import RecipeError
from sftrecipes.recipe.load import load_recipe
from sftrecipes.data.tokenizer import load_tokenizer

WINDOW = 4  # sliding windows small enough to cut into the packed samples below
LENGTHS = [7, 12, 1, 9, 3, 12, 1, 1]  # unequal lengths (several groups), pad-like 1-token segments
# family -> config overrides: a sliding window on Mistral (every layer), Qwen3 and Gemma-3 (their sliding layers)
FAMILIES = {
    "llama3": {},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "mistral": {"sliding_window": WINDOW},
    "gemma3": {"sliding_window": WINDOW},
}


def build(folder, overrides: dict, impl: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    attention.register()
    cfg = AutoConfig.from_pretrained(folder, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
    model.config.use_cache = False  # as load_model trains
    return model.train()


def packed_batch(vocab: int, lengths=LENGTHS):
    """What TRL's padding-free collator gives the model: one row, position_ids restarting per sample, cu_seq_lens."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (sum(lengths),), generator=g).tolist()
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": ids, "seq_lengths": lengths}])
    batch.pop("seq_idx", None)
    return batch


def forward_backward(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_and_gradients_equal_sdpa_block_diagonal(family, family_models):
    overrides = FAMILIES[family]
    model = build(family_models[family], overrides, "sdpa")
    batch = packed_batch(model.config.vocab_size)
    ref_logits, ref_grads = forward_backward(model, batch)  # sdpa: transformers' dense block-diagonal mask

    model.set_attn_implementation(attention.NAME)
    assert model.config._attn_implementation == attention.NAME
    calls = []
    real = attention._segments_sdpa
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_segments_sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
        logits, grads = forward_backward(model, batch)  # segments from the collator's cu_seq_lens_q
    assert calls, "the packed batch did not go through the per-segment path"
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)

    # the same boundaries read from position_ids alone (no cu_seq_lens from the collator)
    by_position = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    torch.testing.assert_close(forward_backward(model, by_position)[0], ref_logits, atol=1e-5, rtol=1e-5)

    # the test can fail: attending across samples (one causal row), or without the window, gives other logits
    causal = {**by_position, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    assert not torch.allclose(forward_backward(model, causal)[0][:, LENGTHS[0]:], ref_logits[:, LENGTHS[0]:], atol=1e-3)
    if overrides.get("sliding_window"):
        wide = build(family_models[family], {**overrides, "sliding_window": 64}, attention.NAME)
        assert not torch.allclose(forward_backward(wide, batch)[0], ref_logits, atol=1e-3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_sample_equals_the_sample_run_alone(family, family_models):
    """Each sample's logits (so its loss) in the packed row equal the same sample run by itself, unpacked."""
    model = build(family_models[family], FAMILIES[family], attention.NAME).eval()
    batch = packed_batch(model.config.vocab_size)
    with torch.no_grad():
        packed = model(**batch).logits[0]
        start = 0
        for n in LENGTHS:
            alone = model(input_ids=batch["input_ids"][:, start:start + n]).logits[0]
            torch.testing.assert_close(packed[start:start + n], alone, atol=1e-5, rtol=1e-5)
            labels = batch["input_ids"][0, start + 1:start + n]
            if n > 1:  # the sample's own loss, packed and alone
                f = torch.nn.functional.cross_entropy
                torch.testing.assert_close(f(packed[start:start + n - 1], labels), f(alone[:-1], labels), atol=1e-5, rtol=1e-5)
            start += n


def test_batches_of_several_packed_rows(family_models):
    """Two packed rows (position_ids restart within each row, no cu_seq_lens) attend per sample in each row."""
    model = build(family_models["mistral"], FAMILIES["mistral"], "sdpa").eval()
    ids = torch.randint(4, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([list(range(9)) + list(range(7)), list(range(5)) + list(range(11))])
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
        model.set_attn_implementation(attention.NAME)
        torch.testing.assert_close(model(input_ids=ids, position_ids=pos).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_padded_batches_and_cached_generation_are_sdpa(family, family_models):
    """A padded batch (2-D attention mask) and generation over a KV cache run transformers' sdpa, bit for bit."""
    sdpa = build(family_models[family], FAMILIES[family], "sdpa").eval()
    varlen = build(family_models[family], FAMILIES[family], attention.NAME).eval()
    ids = torch.randint(4, sdpa.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        assert torch.equal(sdpa(input_ids=ids, attention_mask=mask).logits, varlen(input_ids=ids, attention_mask=mask).logits)
    for m in (sdpa, varlen):
        m.config.use_cache = True
        m.generation_config.pad_token_id = 0
    prompt = dict(input_ids=ids[:2, :6], attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]))
    kw = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(sdpa.generate(**prompt, **kw), varlen.generate(**prompt, **kw))


def test_segment_bounds():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert attention.segment_bounds(1, 8, "cpu", position_ids=pos)[0].tolist() == [0, 3, 5, 6, 8]
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    bounds, from_collator = attention.segment_bounds(1, 8, "cpu", cu_seq_lens=cu, position_ids=pos)
    assert bounds.tolist() == [0, 4, 8] and from_collator
    bounds, from_collator = attention.segment_bounds(2, 4, "cpu", cu_seq_lens=cu)  # 2 rows: not the collator's row
    assert bounds.tolist() == [0, 4, 8] and not from_collator  # no positions either: one segment per row
    assert attention.segment_bounds(2, 4, "cpu", position_ids=torch.tensor([[0, 1, 0, 1]]))[0].tolist() == [0, 2, 4, 6, 8]


def test_the_flash_kernel_path_reads_nothing_back_from_the_device(monkeypatch):
    """On a GPU, attention runs in every layer of every step: with the collator's cu_seq_lens and max_length_q the
    call into torch's varlen kernel must not read a device value (each read is a host sync). Everything up to the
    kernel runs here on CPU, the kernel itself stood in for by the per-segment path (the real one needs CUDA:
    test_cuda_varlen_kernel_matches_the_segment_path); any tensor read made by attention.py fails the test."""
    import sys

    def forbid(name):
        orig = getattr(torch.Tensor, name)

        def read(*a, **kw):
            if sys._getframe(1).f_code.co_filename == attention.__file__ and not inside_stand_in:
                raise AssertionError(f"attention.py reads the device ({name}) on the flash-kernel path")
            return orig(*a, **kw)
        return read

    seen, inside_stand_in = [], []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0), enable_gqa=False):
        seen.append((cu_q, max_q, window_size, enable_gqa))
        inside_stand_in.append(True)  # the stand-in may read (the real kernel runs on the device)
        try:
            return attention._segments_sdpa(q, k, v, cu_q.long(), scale, 0.0,
                                            window_size[0] + 1 if window_size[0] >= 0 else None)
        finally:
            inside_stand_in.clear()

    torch.manual_seed(0)
    lengths = [5, 3, 8]
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    cu = torch.tensor([0, 5, 8, 16], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal = True
    ref, _ = attention.varlen_attention_forward(module, q, k, v, None, position_ids=torch.cat(
        [torch.arange(n) for n in lengths])[None], sliding_window=4)
    monkeypatch.setattr(attention, "_flash_kernel_applies", lambda q, d: True)
    monkeypatch.setattr(attention, "_torch_varlen", lambda: kernel)
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    out, _ = attention.varlen_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                                max_length_q=8, max_length_k=8, sliding_window=4)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0][1:] == (8, (3, 0), True) and torch.equal(seen[0][0], cu)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen flash kernel runs on CUDA only")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_varlen_kernel_matches_the_segment_path(family, family_models):
    """bf16 on CUDA goes through torch.nn.attention.varlen.varlen_attn; it agrees with per-segment sdpa (fp32)."""
    model = build(family_models[family], FAMILIES[family], attention.NAME).cuda().eval()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in packed_batch(model.config.vocab_size).items()}
    with torch.no_grad():
        ref = model(**batch).logits.float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = model.to(torch.bfloat16)(**batch).logits.float()
    assert attention._torch_varlen() is not None
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0.05)


def test_auto_picks_varlen_for_packed_recipes_and_the_model_reports_it(tiny_model, caplog):
    r = load_recipe(["recipes/tiny/lora.yaml"])
    tok, _, _ = load_tokenizer(r)
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        model = models.load_model(r, tok, "cpu")
    assert model.config._attn_implementation == attention.NAME
    lines = [x.getMessage() for x in caplog.records if x.getMessage().startswith("attention:")]
    assert lines == ["attention: sft_varlen (auto: packed batches attend per sample; flash_attention_2 does not run here)"]
    unpacked = models.load_model(load_recipe(["recipes/tiny/lora.yaml", "--packing", "false"]), tok, "cpu")
    assert unpacked.config._attn_implementation == "sdpa"


def test_gemma2_soft_capping_gets_eager_and_an_explicit_sft_varlen_is_refused(family_models, caplog):
    gemma2 = ["recipes/tiny/lora.yaml", "--model_name_or_path", str(family_models["gemma2"])]
    with pytest.raises(RecipeError) as e:
        attnchoice.choose_attention(load_recipe([*gemma2, "--attn_implementation", "sft_varlen"]), "cpu")
    assert str(e.value) == ("attn_implementation: sft_varlen cannot apply Gemma2ForCausalLM's attention logit soft-capping "
                            "(attn_logit_softcapping); use attn_implementation: auto (or one of eager, flash_attention_2)")
    r = load_recipe(gemma2)
    tok, _, _ = load_tokenizer(r)
    with caplog.at_level(logging.INFO, logger="sftrecipes"):
        model = models.load_model(r, tok, "cpu")
    assert model.config._attn_implementation == "eager"
    lines = [x for x in caplog.records if "attention" in x.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [x.getMessage() for x in lines]
    assert lines[0].getMessage().startswith("attention: eager") and "attn_logit_softcapping" in lines[0].getMessage()


# --------------------------------------------------------------- the choice read from the model class (issue 18)

def _choice(folder, hardware="cpu", *flags):
    return attnchoice.choose_attention(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(folder), *flags]), hardware)


@pytest.mark.parametrize("model", ["llama", "gemma2", "gemma3_multimodal", "gpt_oss"])
def test_auto_attention_is_what_the_loaded_class_supports(model, tiny_model, family_models, gemma3_multimodal_model,
                                                          gpt_oss_model):
    """auto, packed and unpacked, on CPU and on a GPU without flash-attn, for the class AutoModelForCausalLM loads:
    GPT-OSS's sinks and Gemma-2's soft-capping keep sft_varlen out (and neither has sdpa: eager); Gemma-3's
    multimodal class (Gemma3ForConditionalGeneration) and Llama take sft_varlen packed, sdpa padded."""
    folder, cls, packed_want, padded_want = {
        "llama": (tiny_model, "LlamaForCausalLM", attention.NAME, "sdpa"),
        "gemma2": (family_models["gemma2"], "Gemma2ForCausalLM", "eager", "eager"),
        "gemma3_multimodal": (gemma3_multimodal_model, "Gemma3ForConditionalGeneration", attention.NAME, "sdpa"),
        "gpt_oss": (gpt_oss_model, "GptOssForCausalLM", "eager", "eager"),
    }[model]
    sup = attnchoice.attention_support(load_recipe(["recipes/tiny/lora.yaml", "--model_name_or_path", str(folder)]))
    assert sup.cls == cls
    for hardware in ("cpu", "gpu"):
        assert _choice(folder, hardware)[0] == packed_want
        assert _choice(folder, hardware, "--packing", "false")[0] == padded_want
    if model == "gpt_oss":
        assert "attention sinks" in sup.traits and "sinks" in _choice(folder)[1]
    if model == "gemma2":
        assert "logit soft-capping" in sup.traits


def test_the_choice_follows_the_class_flags(tiny_model, gemma3_multimodal_model, gpt_oss_model, monkeypatch):
    """The decision reads the loaded class's own flags: flip one and the choice follows (no table in between)."""
    from transformers import Gemma3ForConditionalGeneration, GptOssForCausalLM, LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "_supports_sdpa", False)
    assert _choice(tiny_model, "cpu", "--packing", "false") == ("eager", "auto: LlamaForCausalLM does not support sdpa (_supports_sdpa False)")
    monkeypatch.setattr(LlamaForCausalLM, "_supports_attention_backend", False)
    assert _choice(tiny_model)[0] == "eager"  # packed: sft_varlen needs transformers' attention interface
    # a GPU with flash-attn, bf16: flash_attention_2 where the class supports it, and not where it does not
    monkeypatch.setattr(attnchoice, "flash_attn_installed", lambda: True)
    assert _choice(tiny_model, "gpu", "--bf16", "true")[0] == "flash_attention_2"
    assert _choice(gemma3_multimodal_model, "gpu", "--bf16", "true")[0] == attention.NAME
    monkeypatch.setattr(Gemma3ForConditionalGeneration, "_supports_flash_attn", True)
    assert _choice(gemma3_multimodal_model, "gpu", "--bf16", "true")[0] == "flash_attention_2"
    # GPT-OSS's flash kernels are hub kernels (_compatible_flash_implementations); without that list the flash-attn
    # package would still drop its sinks
    monkeypatch.setattr(GptOssForCausalLM, "_compatible_flash_implementations", None)
    assert _choice(gpt_oss_model, "gpu", "--bf16", "true")[0] == "eager"
    monkeypatch.setattr(attnchoice, "attention_traits", lambda cfg, model: ())
    assert _choice(gpt_oss_model, "gpu", "--bf16", "true")[0] == "flash_attention_2"


def test_use_flash_attn_falls_back_on_every_model_and_an_explicit_kernel_is_refused(gemma3_multimodal_model, gpt_oss_model,
                                                                                     tiny_model):
    """use_flash_attn (the guide's switch) falls back to the auto choice with a reason, whatever stops flash attention:
    the class (Gemma3ForConditionalGeneration drops flash attention; GPT-OSS needs a hub kernel) or the machine. An
    explicit attn_implementation the class cannot run is one line naming the key and what it can run."""
    for folder, want, why in ((gemma3_multimodal_model, attention.NAME, "Gemma3ForConditionalGeneration does not support flash_attention_2"),
                              (gpt_oss_model, "eager", "GptOssForCausalLM runs flash attention only through"),
                              (tiny_model, attention.NAME, "flash_attention_2 needs the flash-attn package")):
        for hardware in ("cpu", "gpu"):
            impl, reason = _choice(folder, hardware, "--use_flash_attn", "true")
            assert impl == want and reason.startswith(f"fallback: {why}"), reason
    refused = {
        (gemma3_multimodal_model, "flash_attention_2"): "Gemma3ForConditionalGeneration does not support flash_attention_2 "
        "(_supports_flash_attn False); use attn_implementation: auto (or one of sdpa, eager, sft_varlen)",
        (gpt_oss_model, "sft_varlen"): "sft_varlen cannot apply GptOssForCausalLM's attention sinks (its sinks parameters); "
        "use attn_implementation: auto (or eager)",
        (gpt_oss_model, "sdpa"): "GptOssForCausalLM does not support sdpa (_supports_sdpa False); use attn_implementation: "
        "auto (or eager)",
    }
    for (folder, impl), msg in refused.items():
        with pytest.raises(RecipeError) as e:
            _choice(folder, "cpu", "--attn_implementation", impl)
        assert str(e.value) == f"attn_implementation: {msg}"


def test_gpt_oss_auto_kernel_trains_a_packed_batch_where_sft_varlen_would_fail(gpt_oss_model):
    """The kernel auto picks for GPT-OSS runs a packed forward and backward; sft_varlen, which the choice keeps out,
    stops at its sinks (the failure issue 18 met after loading)."""
    impl = _choice(gpt_oss_model)[0]
    model = build(gpt_oss_model, {}, impl)
    batch = packed_batch(model.config.vocab_size)
    logits, grads = forward_backward(model, batch)
    assert torch.isfinite(logits).all() and any(n.endswith("sinks") for n in grads)
    model.set_attn_implementation(attention.NAME)
    with pytest.raises(ValueError, match="sft_varlen has no attention sinks"):
        forward_backward(model, batch)


def test_an_explicit_kernel_the_model_cannot_run_exits_2_before_loading(gpt_oss_model, tmp_path):
    """Refused in the rank before the tokenizer, the data or the model load, and before anything is written: one
    line naming the key, exit 2 (each rank decides from the config alone, so every rank says the same)."""
    out = tmp_path / "out"
    res = run_cli(["train.py", "recipes/tiny/lora.yaml", "--model_name_or_path", str(gpt_oss_model), "--attn_implementation",
                   "sft_varlen", "--output_dir", str(out)], timeout=300)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and errors == [
        "error: attn_implementation: sft_varlen cannot apply GptOssForCausalLM's attention sinks (its sinks parameters); "
        "use attn_implementation: auto (or eager)"], res.stderr[-3000:]
    assert "chat template:" not in res.stderr and "data:" not in res.stderr  # neither tokenizer nor data was prepared
    assert not out.exists()
