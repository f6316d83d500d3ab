"""The latent cache must give exactly what a forward without cache gives, in every mode and in `generate`."""

import itertools
from collections.abc import Callable

import pytest
import torch

from egmla import EGMLACache, cache_nbytes
from egmla.configuration_egmla import EGMLA_LAYER_TYPE
from tests.utils import MODES, assert_cache_equals_no_cache, generate_both, incremental_logits, tiny_model

ALL_MODES = list(MODES)
# A windowed layer keeps its window only (test_a_windowed_layers_cache_keeps_its_window_only): these hold every position.
UNWINDOWED_MODES = [mode for mode in MODES if "sliding_window" not in MODES[mode]]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_prefill_plus_20_steps_equals_no_cache(mode, attn_implementation):
    model = tiny_model(**MODES[mode])
    model.set_attn_implementation(attn_implementation)
    assert_cache_equals_no_cache(model, (2, 27), prefill=7, seed=1)


@pytest.mark.parametrize(
    "overrides",
    [
        {"q_lora_rank": 24},
        {"rope_key_heads": 2},
        {"rope_key_heads": 4, "gate_layers_per_table": 2},
        {"gate_norm": "none"},
        {"kv_latent_norm": False},
        {"qk_nope_head_dim": 0},
        {"kv_lora_rank": [16, 6]},
        {
            "rope_key_heads": 2,
            "rope_frequency_dim": 16,
            "rope_frequency_indices": [[[0, 3, 5, 7], [1, 2, 4, 6]], [[4, 5, 6, 7], [0, 1, 2, 3]]],
        },
    ],
    ids=[
        "q_lora",
        "rope_key_heads=2",
        "rope_key_heads=4,shared-table",
        "gate_norm=none",
        "no-latent-norm",
        "no-nope",
        "per-layer-ranks",
        "per-head-rope-frequencies",
    ],
)
@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_variants_cache_equals_no_cache(overrides, gate_position):
    model = tiny_model(gate_position=gate_position, **overrides)
    assert_cache_equals_no_cache(model, (2, 15), prefill=4, seed=2)


@pytest.mark.parametrize(
    "overrides",
    [
        {"q_lora_rank": 24},
        {"gate_norm": "none"},
        {"kv_latent_norm": False},
        {"qk_nope_head_dim": 0},
        {"kv_lora_rank": [16, 6]},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 8}},
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ],
    ids=["q_lora", "gate_norm=none", "no-latent-norm", "no-nope", "per-layer-ranks", "yarn", "llama3", "dynamic"],
)  # fmt: skip
@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_exact_rope_variants_cache_equals_no_cache(overrides, gate_position):
    model = tiny_model(gate_position=gate_position, rope_mode="exact", **overrides)
    assert_cache_equals_no_cache(model, (2, 15), prefill=4, seed=2)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": 500000.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda params: params["rope_type"],
)
def test_rope_scaling_types(rope_parameters):
    model = tiny_model(rope_parameters=rope_parameters)
    assert model.model.rotary_emb.rope_type == rope_parameters["rope_type"]
    assert_cache_equals_no_cache(model, (1, 12), prefill=5, seed=3)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_generate_greedy_sampling_beam(mode):
    model = tiny_model(**MODES[mode])
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    common = {"input_ids": prompt, "max_new_tokens": 12, "min_new_tokens": 12}

    cached, uncached = generate_both(model, **common, do_sample=False)
    assert torch.equal(cached, uncached)

    torch.manual_seed(7)
    sampled_cached = model.generate(**common, do_sample=True, top_k=0, use_cache=True)
    torch.manual_seed(7)
    sampled_uncached = model.generate(**common, do_sample=True, top_k=0, use_cache=False)
    assert torch.equal(sampled_cached, sampled_uncached)

    cached, uncached = generate_both(model, **common, num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_left_padded_batch_equals_each_prompt_alone(mode):
    model = tiny_model(**MODES[mode])
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (length,), generator=generator) for length in (9, 4, 6)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        attention_mask[row, width - len(prompt) :] = 1

    options = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    with torch.no_grad():
        batch = model.generate(input_ids=input_ids, attention_mask=attention_mask, **options)
        batch_uncached = model.generate(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **options)
        assert torch.equal(batch, batch_uncached)
        for row, prompt in enumerate(prompts):
            alone = model.generate(input_ids=prompt[None], **options)
            assert torch.equal(batch[row, width:], alone[0, len(prompt) :])


@pytest.mark.parametrize("mode", ALL_MODES)
def test_assisted_decoding_with_itself(mode):
    model = tiny_model(**MODES[mode])
    prompt = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    options = {"input_ids": prompt, "max_new_tokens": 14, "min_new_tokens": 14, "do_sample": False}
    with torch.no_grad():
        plain = model.generate(**options)
        assisted = model.generate(**options, assistant_model=model)
    assert torch.equal(plain, assisted)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_prompt_lookup_decoding_gives_the_greedy_tokens(mode):
    """Prompt lookup drafts from n-grams of the prompt; a repeating prompt makes its drafts accepted and rejected,
    so the cache is cropped and continued."""
    model = tiny_model(**MODES[mode])
    prompt = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(7)).repeat(1, 3)
    options = {"input_ids": prompt, "max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    with torch.no_grad():
        plain = model.generate(**options)
        looked_up = model.generate(**options, prompt_lookup_num_tokens=3)
    assert torch.equal(plain, looked_up)


@pytest.mark.parametrize("mode", UNWINDOWED_MODES)
def test_cache_holds_exactly_the_latent_rope_key_ids_and_positions(mode):
    model = tiny_model(**MODES[mode], num_hidden_layers=3, kv_lora_rank=[16, 8, 12])
    config = model.config
    batch, prompt_length, new_tokens = 3, 7, 9
    prompt = torch.randint(3, 128, (batch, prompt_length), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
        )
    cache = out.cache
    seq = prompt_length + new_tokens - 1  # the last sampled token never enters the cache
    itemsize = torch.finfo(torch.float32).bits // 8
    latent_bytes = batch * seq * config.kv_cache_values_per_token() * itemsize
    ids_bytes = batch * seq * 8 if config.caches_token_ids else 0
    position_bytes = batch * seq * 8 if config.caches_positions else 0
    assert cache_nbytes(cache) == latent_bytes + ids_bytes + position_bytes

    # Nothing else: every layer holds exactly [B,1,T,r] and [B,1,T,Hr*dr] (0 wide in "exact" rope mode), plus the
    # ids and the positions [B,T] once, in layer 0, where the mode needs them.
    rope_width = 0 if config.rope_mode == "exact" else config.rope_key_heads * config.qk_rope_head_dim
    rope_width += config.key_scale_width  # qk_norm: each key head's norm scale, beside the rope key
    per_token = {"token_ids"} if ids_bytes else set()
    per_token |= {"positions"} if position_bytes else set()
    for index, layer in enumerate(cache.layers):
        assert layer._layer_type == EGMLA_LAYER_TYPE and type(layer).__name__ == "EGMLALatentCacheLayer"
        assert layer.keys.shape == (batch, 1, seq, config.layer_kv_lora_rank(index))
        assert layer.values.shape == (batch, 1, seq, rope_width)
        tensors = {name for name, value in vars(layer).items() if isinstance(value, torch.Tensor)}
        assert tensors - {"storage"} == ({"keys", "values"} | (per_token if index == 0 else set()))
        if "storage" in tensors:  # the memory behind keys and values (rows [latent ; rope key]), not another copy
            storage = layer.storage.untyped_storage().data_ptr()
            assert layer.keys.untyped_storage().data_ptr() == layer.values.untyped_storage().data_ptr() == storage
    if ids_bytes:
        assert torch.equal(cache.layers[0].token_ids, out.sequences[:, :seq])
    if position_bytes:
        assert torch.equal(cache.layers[0].positions, torch.arange(seq).expand(batch, seq))


def test_cache_operations_keep_ids_aligned():
    model = tiny_model(gate_position="kv")
    cache = EGMLACache(model.config)
    input_ids = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        model(input_ids, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 6 and cache.token_ids.shape == (3, 6)

    latent = cache.layers[1].keys.clone()
    cache.crop(-2)
    assert cache.get_seq_length() == 4 and torch.equal(cache.token_ids, input_ids[:, :4])
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(cache.token_ids, input_ids[[2, 0, 1], :4])
    assert torch.equal(cache.layers[1].keys, latent[[2, 0, 1], :, :4])
    cache.batch_repeat_interleave(2)
    assert cache.token_ids.shape == (6, 4) and cache.layers[1].keys.shape[0] == 6
    cache.batch_select_indices(torch.tensor([0, 5]))
    assert torch.equal(cache.token_ids, input_ids[[2, 1], :4])
    assert cache.layers[0].keys.shape[0] == 2
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.token_ids is None and cache.nbytes() == 0


def test_cache_operations_keep_positions_aligned_in_exact_rope_mode():
    """Left-padded rows cache their own positions; crop, beam reorder, repetition and selection keep them with
    the latent, so the logits after each operation still equal a forward without cache."""
    model = tiny_model(**MODES["exact-gate-kv"])
    input_ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(14))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # row 1 is left-padded by 3
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = EGMLACache(model.config)
    with torch.no_grad():
        model(input_ids[:, :7], attention_mask=attention_mask[:, :7], position_ids=position_ids[:, :7], cache=cache)
        assert torch.equal(cache.layers[0].positions, position_ids[:, :7])
        cache.crop(-2)
        assert torch.equal(cache.layers[0].positions, position_ids[:, :5])
        cache.reorder_cache(torch.tensor([1, 2, 0]))
        cache.batch_repeat_interleave(2)
        cache.batch_select_indices(torch.tensor([0, 3, 4]))  # rows 1, 2, 0 of the original batch
        order = torch.tensor([1, 2, 0])
        assert torch.equal(cache.layers[0].positions, position_ids[order, :5])
        step = model(
            input_ids[order, 5:9], attention_mask=attention_mask[order], position_ids=position_ids[order, 5:9],
            cache=cache,
        ).logits  # fmt: skip
        reference = model(input_ids[order], attention_mask=attention_mask[order], position_ids=position_ids[order])
    torch.testing.assert_close(step, reference.logits[:, 5:9], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["exact", "exact-gate-kv"])
def test_a_generation_continues_from_its_cache_in_exact_rope_mode(mode):
    """Both ways of continuing: `generate` again with the returned cache, and forward steps on that cache."""
    model = tiny_model(**MODES[mode])
    prompt = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(15))
    options = {"do_sample": False, "return_dict_in_generate": True}
    with torch.no_grad():
        whole = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, **options).sequences
        first = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, **options)
        again = model.generate(first.sequences, cache=first.cache, max_new_tokens=6, min_new_tokens=6, **options)
        assert torch.equal(again.sequences, whole)
        first = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, **options)
        logits = model(first.sequences[:, -1:], cache=first.cache).logits
        reference = model(first.sequences).logits[:, -1:]
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_out_of_range_token_ids_raise_before_indexing():
    model = tiny_model()
    with pytest.raises(ValueError, match="vocab_size=128"):
        model(torch.tensor([[5, 128]]))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[-1, 5]]))
    cache = EGMLACache(model.config)
    model(torch.tensor([[5, 6]]), cache=cache)
    with pytest.raises(ValueError, match="vocab_size=128"):  # a decode step: CPU ids are checked at no cost
        model(torch.tensor([[300]]), cache=cache)
    with pytest.raises(ValueError, match="vocab_size=128"):  # a prompt: once per generate call
        model.generate(torch.tensor([[5, 130]]), max_new_tokens=2)


def test_gate_needs_token_ids():
    model = tiny_model()
    with pytest.raises(ValueError, match="input_ids"):
        model(inputs_embeds=torch.zeros(1, 3, 64))
    plain = tiny_model(gate_embedding_dim=0)
    embeds = plain.model.embed_tokens(torch.tensor([[4, 5, 6]]))
    assert torch.allclose(plain(inputs_embeds=embeds).logits, plain(torch.tensor([[4, 5, 6]])).logits)


def test_kv_gate_refuses_a_cache_without_token_ids():
    from transformers import DynamicCache

    model = tiny_model(gate_position="kv")
    with pytest.raises(ValueError, match="EGMLACache"):
        model(torch.tensor([[4, 5]]), cache=DynamicCache(), use_cache=True)


def test_fresh_gate_is_the_identity():
    """W^{UE} starts at zero: a fresh EG-MLA model equals the same weights with the gate off."""
    torch.manual_seed(0)
    from egmla import EGMLAForCausalLM
    from tests.utils import tiny_config

    gated = EGMLAForCausalLM(tiny_config(gate_norm="none")).eval()
    plain = EGMLAForCausalLM(tiny_config(gate_embedding_dim=0)).eval()
    missing, unexpected = plain.load_state_dict(gated.state_dict(), strict=False)
    assert not missing and all("gate_" in key for key in unexpected)
    assert all(layer.self_attn.gate_embedding_proj.weight.abs().sum() == 0 for layer in gated.model.layers)
    input_ids = torch.tensor([[4, 9, 33, 7]])
    assert torch.allclose(gated(input_ids).logits, plain(input_ids).logits, atol=1e-6)


def test_rope_frequency_indices_select_the_rotary_frequencies():
    """Explicit indices of the first frequencies equal the default; other indices rotate differently."""
    input_ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(10))
    default = tiny_model(rope_key_heads=2)
    explicit = tiny_model(rope_key_heads=2, rope_frequency_indices=[[[0, 1, 2, 3], [0, 1, 2, 3]]] * 2)
    shuffled = tiny_model(
        rope_key_heads=2, rope_frequency_indices=[[[0, 1, 2, 3], [0, 1, 2, 3]], [[0, 1, 2, 3], [3, 2, 1, 0]]]
    )
    with torch.no_grad():
        assert torch.equal(default(input_ids).logits, explicit(input_ids).logits)
        assert not torch.allclose(default(input_ids).logits, shuffled(input_ids).logits)
        # A wider frequency table whose first half of the pairs is picked: cos/sin come from rope_frequency_dim.
        wide = tiny_model(rope_frequency_dim=16)
        assert wide.model.rotary_emb.inv_freq.shape == (8,)
        assert not torch.allclose(default(input_ids).logits, wide(input_ids).logits)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_assisted_decoding_with_a_different_assistant(mode):
    """A weaker assistant gets tokens rejected, so the main model's cache is cropped mid-generation."""
    model = tiny_model(**MODES[mode])
    assistant = tiny_model(seed=1, **MODES[mode], num_hidden_layers=1)
    crops = []
    original_crop = EGMLACache.crop

    prompt = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(11))
    options = {"input_ids": prompt, "max_new_tokens": 14, "min_new_tokens": 14, "do_sample": False}
    with torch.no_grad():
        plain = model.generate(**options)
        cache = EGMLACache(model.config)
        cache.crop = lambda tokens: crops.append(tokens) or original_crop(cache, tokens)
        assisted = model.generate(**options, assistant_model=assistant, cache=cache)
    assert torch.equal(plain, assisted)
    assert any(tokens < 0 for tokens in crops)  # some candidates were rejected and cropped away


@pytest.mark.parametrize("mode", UNWINDOWED_MODES)
def test_logits_after_crop_equal_no_cache(mode):
    model = tiny_model(**MODES[mode])
    input_ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        reference = model(input_ids).logits
        cache = EGMLACache(model.config)
        model(input_ids[:, :10], cache=cache)
        cache.crop(-3)  # back to 7 tokens, then continue with chunks of 5 and 4
        first = model(input_ids[:, 7:12], cache=cache).logits
        second = model(input_ids[:, 12:16], cache=cache).logits
    torch.testing.assert_close(torch.cat([first, second], dim=1), reference[:, 7:], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_key_heads": 2, "rope_frequency_dim": 16, "rope_frequency_indices": [[[0, 3, 5, 7], [1, 2, 4, 6]]] * 2},
        {"rope_frequency_dim": 16},
        {},
    ],
    ids=["per-head-indices", "wider-frequency-table", "default"],
)
def test_attention_depends_only_on_relative_positions(overrides):
    """Shifting every position leaves the logits unchanged only if each query head rotates with exactly the
    frequencies of the rope key it attends to."""
    model = tiny_model(**overrides)
    input_ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(13))
    positions = torch.arange(12)[None]
    with torch.no_grad():
        reference = model(input_ids, position_ids=positions).logits
        shifted = model(input_ids, position_ids=positions + 37).logits
    torch.testing.assert_close(reference, shifted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_static_cache_generates_the_dynamic_caches_tokens(mode):
    """`cache_implementation="static"` preallocates the latent cache (and the token ids / positions the mode needs):
    greedy with left padding, beam search and seeded sampling give the dynamic cache's tokens."""
    model = tiny_model(gate_std=0.3, **MODES[mode])
    prompts = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(prompts)
    prompts[0, :2], attention_mask[0, :2] = 0, 0
    for settings in (
        {"do_sample": False},
        {"do_sample": False, "num_beams": 2},
        {"do_sample": True, "top_k": 5},
    ):
        runs = []
        for cache_implementation in (None, "static"):
            torch.manual_seed(0)
            runs.append(model.generate(prompts, attention_mask=attention_mask, max_new_tokens=6,
                                       cache_implementation=cache_implementation, **settings))  # fmt: skip
        assert torch.equal(*runs), settings


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_an_unpadded_prompt_into_a_static_cache_gives_the_uncached_logits(mode, attn_implementation):
    """No mask, several tokens: a prompt at offset 0, the static cache's unwritten slots after it must stay unseen."""
    from transformers import StaticCache

    model = tiny_model(gate_std=0.3, **MODES[mode])
    model.set_attn_implementation(attn_implementation)
    input_ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        reference = model(input_ids).logits
        cached = incremental_logits(
            model, input_ids, prefill=5, cache=StaticCache(config=model.config, max_cache_len=16)
        )
        expected = model.generate(input_ids, max_new_tokens=5, do_sample=False)
        static = model.generate(input_ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    torch.testing.assert_close(reference, cached, rtol=0, atol=1e-5)
    assert torch.equal(static, expected)


def test_gradients_flow_through_cached_decode_steps():
    """Training through a cache (prefill, then steps): the chunked storage is written in place, so under autograd
    the cache concatenates instead; every parameter's gradient equals the uncached forward's."""
    for mode in ("mla-absorbed", "gate-kv"):
        model = tiny_model(**MODES[mode])
        cache = EGMLACache(model.config)
        input_ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(9))
        logits = [model(input_ids[:, :4], cache=cache).logits[:, -1]]
        for step in (4, 5):
            logits.append(model(input_ids[:, step : step + 1], cache=cache).logits[:, -1])
        torch.stack(logits).sum().backward()
        cached = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        model(input_ids).logits[:, 3:6].sum().backward()  # the same three positions, no cache
        assert cached["model.layers.0.self_attn.kv_b_proj.weight"].abs().sum() > 0, mode
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(cached[name], parameter.grad, rtol=1e-4, atol=1e-5, msg=f"{mode}: {name}")


def test_static_cache_holds_the_arithmetic_for_its_preallocated_length():
    from transformers import StaticCache

    model = tiny_model(gate_position="kv", rope_mode="exact")  # latent, token ids and positions
    cache = StaticCache(config=model.config, max_cache_len=40)
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 9)), cache=cache)
    latent_bytes = 4 * sum(model.config.layer_kv_lora_rank(layer) for layer in range(model.config.num_hidden_layers))
    assert cache_nbytes(cache, allocated=True) == 2 * 40 * (latent_bytes + 8 + 8)  # fp32 latents; int64 ids, positions
    assert cache_nbytes(cache) == 2 * 9 * (latent_bytes + 8 + 8)  # the 9 positions in use
    assert int(cache.get_seq_length()) == 9


def test_a_compiled_static_decode_step_has_no_graph_break_and_does_not_recompile():
    """The whole decode step compiles to one graph (no host sync, no data-dependent branch: the id check and the
    distinct-token lookup stay out of compiled graphs), and later steps reuse it."""
    from transformers import StaticCache

    for mode in ("gate-kv", "exact-gate-kv", "mla"):
        model = tiny_model(gate_std=0.3, **MODES[mode])
        cache = StaticCache(config=model.config, max_cache_len=24)
        with torch.no_grad():
            token = model(torch.randint(3, 128, (2, 5)), cache=cache).logits[:, -1:].argmax(-1)
            explanation = torch._dynamo.explain(model.forward)(token, cache=cache, position_ids=torch.tensor([[5]]))
        assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    model = tiny_model(gate_std=0.3, **MODES["gate-kv"])
    prompts = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    expected = model.generate(prompts, max_new_tokens=6, do_sample=False)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, dynamic=False)
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=16)
        logits = model(prompts, cache=cache).logits  # prefill (its own graph)
        tokens = [logits[:, -1:].argmax(-1)]
        for step in range(5):
            with torch._dynamo.config.patch(error_on_recompile=step >= 2):  # steps 0 and 1 build the decode graph
                position = torch.tensor([[5 + step]])
                tokens.append(model(tokens[-1], cache=cache, position_ids=position).logits[:, -1:].argmax(-1))
    assert torch.equal(torch.cat([prompts, *tokens], dim=1), expected)


def graph_counting_backend() -> tuple[list, Callable]:
    """A backend that records every graph dynamo compiles and runs it eagerly (with `fullgraph=True` one graph per
    compilation). A plain function, as `CompileConfig.to_dict` deep-copies its backend (a counter object's copy
    would count unseen)."""
    graphs = []

    def backend(graph_module, example_inputs, **options):
        graphs.append(graph_module)
        return graph_module.forward

    return graphs, backend


def left_padded_generate(model, **settings) -> torch.Tensor:
    input_ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, **settings)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_generate_compiled_over_a_static_cache_decodes_a_padded_batch_with_one_graph(mode):
    """transformers' compile path (`compile_config`): every decode step gets the [B, 1, 1, L] mask of the model's
    `create_masks_for_generate`, not the 2-D mask that grows a position per step, so no step recompiles."""
    from transformers.generation import CompileConfig

    model = tiny_model(gate_std=0.3, **MODES[mode])
    expected = left_padded_generate(model)
    graphs, backend = graph_counting_backend()
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    compile_config._compile_all_devices = True  # compile on the CPU too
    torch._dynamo.reset()
    tokens = left_padded_generate(model, cache_implementation="static", compile_config=compile_config)
    assert len(graphs) == 1  # the decode step's (the prefill is not compiled)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("mode", ["gate-kv", "exact-gate-latent"])
def test_a_compiled_forward_generates_a_padded_batch_over_a_static_cache_with_two_graphs(mode):
    """`model.forward = torch.compile(...)`: the prefill's graph and one decode graph, whatever the steps."""
    model = tiny_model(gate_std=0.3, **MODES[mode])
    expected = left_padded_generate(model)
    graphs, backend = graph_counting_backend()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=False)
    tokens = left_padded_generate(model, cache_implementation="static")
    assert len(graphs) == 2
    assert torch.equal(tokens, expected)


def test_the_dynamic_latent_cache_grows_by_chunks_not_by_copying_every_step():
    model = tiny_model()
    cache = EGMLACache(model.config)
    input_ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(input_ids[:, :4], cache=cache)
        layer = cache.layers[1]
        storage = layer.keys.data_ptr()
        for step in range(4, 10):
            model(input_ids[:, step : step + 1], cache=cache)
            assert layer.keys.data_ptr() == storage and layer.keys.shape[2] == step + 1  # written in place
        assert layer.storage.shape[2] == layer.GROWTH_CHUNK
        cache.reorder_cache(torch.tensor([1, 0]))  # a new tensor: the next step moves to a new storage
        model(input_ids[:, :1], cache=cache)
        width = layer.keys.shape[-1]  # one storage of rows [latent ; rope key]
        assert layer.keys.shape[2] == 11 and torch.equal(layer.keys, layer.storage[:, :, :11, :width])
        assert torch.equal(layer.values, layer.storage[:, :, :11, width:])
    per_position = 2 * 4 * sum(model.config.layer_kv_lora_rank(i) + model.config.rope_key_width for i in range(2))
    ids = 2 * 8 * model.config.caches_token_ids  # int64 ids of 2 rows, kept once
    assert cache_nbytes(cache) == 11 * (per_position + ids)  # what the cache holds for its tokens
    # and what it allocated: each layer's storage of a whole chunk (the ids are concatenated, exact)
    assert cache_nbytes(cache, allocated=True) == layer.GROWTH_CHUNK * per_position + 11 * ids


@pytest.mark.parametrize("mode", ["mla-absorbed", "gate-latent"])
def test_absorbed_decode_by_sdpa_equals_the_batched_products(mode):
    """The absorbed decode reads the cache's rows [latent ; rope key] with SDPA (no attention weights), the dynamic
    cache's and the static one's; asking for the weights takes the batched products instead: the same logits for
    one new token and for three (left-padded rows, a mask), and uncached logits for both."""
    from transformers import StaticCache

    model = tiny_model(**MODES[mode])
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(input_ids)
    mask[1, :3] = 0  # a left-padded row
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask).logits
        caches = (lambda: EGMLACache(model.config), lambda: StaticCache(config=model.config, max_cache_len=16))
        for need_weights, make_cache in itertools.product((False, True), caches):
            cache = make_cache()
            model(input_ids[:, :8], attention_mask=mask[:, :8], cache=cache)
            rows = cache.layers[0].cached_rows()  # rows side by side: SDPA reads them
            assert rows is not None and rows[..., :8, :].data_ptr() == cache.layers[0].keys.data_ptr()
            steps = [(8, 9), (9, 12)]  # one token, then three
            for start, end in steps:
                out = model(input_ids[:, start:end], attention_mask=mask[:, :end], cache=cache,
                            output_attentions=need_weights)  # fmt: skip
                torch.testing.assert_close(out.logits[1], full[1, start:end], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(out.logits[0], full[0, start:end], rtol=1e-4, atol=1e-4)
                assert (out.attentions is not None) == need_weights


def test_a_windowed_layer_sees_only_its_window():
    """One windowed layer (Gemma 3's local attention): a token's logits depend on the last `sliding_window` tokens
    only, with or without a cache."""
    model = tiny_model(**{**MODES["gemma"], "num_hidden_layers": 1, "sliding_window_layers": [0]})
    input_ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = input_ids.clone()
    changed[0, 0] = 3 if input_ids[0, 0] != 3 else 4
    with torch.no_grad():
        logits, changed_logits = model(input_ids).logits, model(changed).logits
        cached = incremental_logits(model, changed, prefill=3, cache=EGMLACache(model.config))
    window = model.config.sliding_window
    assert not torch.allclose(logits[:, :window], changed_logits[:, :window])
    torch.testing.assert_close(logits[:, window:], changed_logits[:, window:], rtol=0, atol=1e-5)
    torch.testing.assert_close(cached, changed_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["gemma", "windowed-exact-gate-kv"])
def test_a_windowed_layers_cache_keeps_its_window_only(mode):
    """generate over a context longer than the window: the windowed layer's cache holds `sliding_window - 1`
    positions (what the next token sees besides itself), the full layer's every one, and cache_nbytes counts that."""
    model = tiny_model(**MODES[mode])
    cache = EGMLACache(model.config)
    input_ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    model.generate(input_ids, max_new_tokens=6, do_sample=False, cache=cache)
    windowed, full = cache.layers
    window = model.config.sliding_window
    assert type(windowed).__name__ == "EGMLASlidingLatentCacheLayer" and windowed.keys.shape[2] == window - 1
    assert full.keys.shape[2] == 25 and windowed.get_seq_length() == full.get_seq_length() == 25
    per_token = sum(values.numel() * 8 for values in (windowed.token_ids, windowed.positions) if values is not None)
    row_bytes = (full.keys.shape[-1] + full.values.shape[-1]) * full.keys.element_size() * 2  # batch 2
    assert cache_nbytes(cache) == row_bytes * (25 + window - 1) + per_token  # the per-token values held whole
    with pytest.raises(ValueError, match="windowed layer's cache holding its window .5. can be cropped only"):
        cache.crop(-3)
