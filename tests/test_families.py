"""Sources of every accepted family (Llama with or without attention biases, Mistral, Qwen2 with q/k/v biases)
convert exactly at full rank in every rope mode; windows that do not cover the context and QK-norm families are
refused by name."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from egmla.conversion import ConversionOptions, convert_llama_to_egmla, load_llama
from tests.utils import assert_same_model, tiny_source, tiny_values

# Full rank per mode on the tiny shape (2 KV heads of 16 dims, 64 wide): every pair in the rope keys, so the latent
# holds the values (32 rows); "exact": every key and value row (2 x (16 + 16) = 64).
FULL_RANK = {
    "per_head": {"kv_lora_rank": 32, "rope_pairs": 8, "rope_split": "per_head"},
    "shared": {"kv_lora_rank": 32, "rope_pairs": 16, "rope_split": "shared"},
    "exact": {"kv_lora_rank": 64, "rope_split": "exact"},
}


@pytest.mark.parametrize("mode", FULL_RANK)
@pytest.mark.parametrize("family", ["llama-bias", "mistral", "qwen2"])
def test_a_source_of_each_family_converts_exactly_at_full_rank(family, mode):
    teacher = tiny_source(family)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(teacher, ConversionOptions(**FULL_RANK[mode], gate_embedding_dim=8), calibration)
    assert student.config.attention_bias == (family != "mistral")
    input_ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_model(student, teacher, input_ids)


def test_a_qwen2_source_keeps_its_biases_where_they_act():
    """The value bias passes the softmax whole (into o_proj's bias); a NoPE key bias is the same for every key of a
    query, so the softmax ignores it; the rope key's bias rotates with it (kv_a_proj's bias)."""
    teacher = tiny_source("qwen2")
    options = ConversionOptions(**FULL_RANK["shared"], gate_embedding_dim=0, factorization="weight")
    student = convert_llama_to_egmla(teacher, options)  # weights only: the bias columns factorized as they are
    source, converted = teacher.model.layers[0].self_attn, student.model.layers[0].self_attn
    value_bias = source.v_proj.bias.view(2, 16).repeat_interleave(4, dim=0).flatten()
    torch.testing.assert_close(converted.o_proj.bias, source.o_proj.weight @ value_bias, rtol=0, atol=1e-5)
    assert converted.kv_a_proj_with_mqa.bias[32:].abs().max() > 0.1  # the rope key's bias
    with torch.no_grad():  # without the bias on o_proj the model would differ
        converted.o_proj.bias.zero_()
        input_ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(1))
        assert (student(input_ids).logits - teacher(input_ids).logits).abs().max() > 1e-2


def test_windows_shorter_than_the_context_and_qk_norm_are_refused_by_name():
    with pytest.raises(ValueError, match="sliding-window attention .sliding_window=32 < max_position_embeddings=128"):
        load_llama(tiny_source("mistral", sliding_window=32))
    with pytest.raises(ValueError, match="sliding-window"):
        load_llama(tiny_source("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0))
    load_llama(tiny_source("mistral", sliding_window=128))  # a window over the whole context changes nothing
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**tiny_values()))
    with pytest.raises(ValueError, match="'qwen3'.*QK-norm.*no low-rank latent rebuilds a normalized key"):
        load_llama(qwen3)
