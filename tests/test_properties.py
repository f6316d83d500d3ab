"""Property-based: for random small configs (widths, heads, grouped rope keys, per-layer latent widths, a low-rank
query or not, every gate mode and rope mode) and every way `generate` uses the cache, the cached generation equals
the uncached one, and the cache holds exactly the arithmetic's bytes.

The default suite runs a bounded number of examples (the "default" profile in conftest.py); the long run is
`python -m pytest tests/test_properties.py --hypothesis-profile=long --hypothesis-show-statistics`.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from egmla import EGMLACache, EGMLAConfig, EGMLAForCausalLM
from egmla.modeling_egmla import cache_nbytes

VOCAB = 64
GENERATE_MODES = ("greedy", "beam", "sampling", "left-padding", "assisted", "crop-then-continue", "unequal-lengths")


@st.composite
def configs(draw) -> EGMLAConfig:
    heads = draw(st.sampled_from([2, 4]))
    layers = draw(st.integers(1, 3))
    rope_mode = draw(st.sampled_from(["decoupled", "exact"]))
    rope_key_heads = 1 if rope_mode == "exact" else draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    per_layer = draw(st.booleans())
    ranks = (
        draw(st.lists(st.integers(3, 12), min_size=layers, max_size=layers)) if per_layer else draw(st.integers(3, 12))
    )
    return EGMLAConfig(
        vocab_size=VOCAB, hidden_size=draw(st.sampled_from([24, 32])), intermediate_size=40,
        num_hidden_layers=layers, num_attention_heads=heads,
        kv_lora_rank=ranks, q_lora_rank=draw(st.sampled_from([None, 12])),
        qk_nope_head_dim=draw(st.sampled_from([4, 8])), qk_rope_head_dim=draw(st.sampled_from([4, 8])),
        v_head_dim=draw(st.sampled_from([4, 6])), rope_key_heads=rope_key_heads, rope_mode=rope_mode,
        gate_embedding_dim=draw(st.sampled_from([0, 6])), gate_position=draw(st.sampled_from(["kv", "latent"])),
        gate_norm=draw(st.sampled_from(["rms", "none"])), gate_layers_per_table=1, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def random_model(config: EGMLAConfig, seed: int) -> EGMLAForCausalLM:
    torch.manual_seed(seed)
    model = EGMLAForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.gate_embedding_proj is not None:  # a gate that acts, not the identity it starts as
                layer.self_attn.gate_embedding_proj.weight.normal_(std=0.3)
    return model


def expected_cache_bytes(config: EGMLAConfig, tokens: int) -> int:
    """The latent and rope keys of every layer, fp32, plus 8-byte token ids / positions where the mode needs them."""
    extra = 8 * (config.caches_token_ids + config.caches_positions)
    return tokens * (config.kv_cache_values_per_token() * 4 + extra)


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :], attention_mask[row, width - len(prompt) :] = prompt, 1
    return input_ids, attention_mask


def check_mode(model: EGMLAForCausalLM, mode: str, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (2, 5), generator=generator)
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    if mode in ("greedy", "beam"):
        extra = {"num_beams": 2} if mode == "beam" else {}
        out = model.generate(prompt, **options, **extra, return_dict_in_generate=True)
        assert torch.equal(out.sequences, model.generate(prompt, **options, **extra, use_cache=False))
        if mode == "greedy":  # the last sampled token never enters the cache
            assert cache_nbytes(out.cache) == expected_cache_bytes(model.config, 2 * (5 + 6 - 1))
    elif mode == "sampling":
        runs = []
        for use_cache in (True, False):
            torch.manual_seed(seed)
            runs.append(model.generate(prompt, **{**options, "do_sample": True}, top_k=0, use_cache=use_cache))
        assert torch.equal(*runs)
    elif mode in ("left-padding", "unequal-lengths"):
        prompts = [torch.randint(3, VOCAB, (length,), generator=generator) for length in (7, 3, 5)]
        input_ids, attention_mask = left_padded(prompts)
        batch = model.generate(input_ids, attention_mask=attention_mask, **options)
        if mode == "unequal-lengths":
            uncached = model.generate(input_ids, attention_mask=attention_mask, **options, use_cache=False)
            assert torch.equal(batch, uncached)
        else:
            for row, alone in enumerate(prompts):
                assert torch.equal(
                    batch[row, input_ids.shape[1] :], model.generate(alone[None], **options)[0, len(alone) :]
                )
    elif mode == "assisted":  # a different assistant: rejected candidates crop the cache mid-generation
        assistant = random_model(model.config, seed + 1)
        single = prompt[:1]
        assert torch.equal(
            model.generate(single, **options, assistant_model=assistant), model.generate(single, **options)
        )
    else:  # crop-then-continue: generate, crop the cache back, generate again from where it now ends
        cache = EGMLACache(model.config)
        first = model.generate(prompt, **options, cache=cache)
        cache.crop(-3)
        kept = cache.get_seq_length()
        continued = model.generate(first[:, : kept + 1], **options, cache=cache)
        assert torch.equal(continued, model.generate(first[:, : kept + 1], **options, use_cache=False))


@given(config=configs(), mode=st.sampled_from(GENERATE_MODES), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_cached_generate_equals_uncached_and_the_cache_holds_the_arithmetic(config, mode, seed):
    check_mode(random_model(config, seed), mode, seed)
