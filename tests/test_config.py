import pytest

from egmla import EGMLAConfig
from egmla.configuration_egmla import EGMLA_LAYER_TYPE
from tests.utils import tiny_config


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"num_attention_heads": 4, "rope_key_heads": 3}, "rope_key_heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 2, "rope_key_heads": 4}, "rope_key_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_hidden_layers": 3, "gate_layers_per_table": 2}, "gate_layers_per_table"),
        ({"gate_position": "values"}, "gate_position"),
        ({"gate_norm": "layer"}, "gate_norm"),
        ({"rope_mode": "full"}, "rope_mode"),
        ({"rope_mode": "exact", "rope_key_heads": 2}, "rope_mode"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"kv_lora_rank": -4}, "kv_lora_rank"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"gate_embedding_dim": -1}, "gate_embedding_dim"),
        ({"qk_nope_head_dim": -1}, "qk_nope_head_dim"),
        ({"hidden_act": "no-such-activation"}, "hidden_act"),
        ({"attention_dropout": 1.5}, "attention_dropout"),
        ({"layer_types": ["full_attention", "full_attention"]}, "layer_types"),
        ({"layer_types": [EGMLA_LAYER_TYPE]}, "layer_types"),
        ({"kv_lora_rank": [16]}, "kv_lora_rank"),
        ({"kv_lora_rank": [16, 0]}, "kv_lora_rank"),
        ({"rope_frequency_dim": 6}, "rope_frequency_dim"),
        ({"rope_frequency_indices": [[[0, 1, 2]], [[0, 1, 2]]]}, "rope_frequency_indices"),
        ({"rope_frequency_indices": [[[0, 1, 2, 3]]]}, "rope_frequency_indices"),
        ({"rope_frequency_indices": [[[0, 1, 2, 4]], [[0, 1, 2, 3]]]}, "rope_frequency_indices"),
        ({"pad_token_id": 500}, "pad_token_id"),
        ({"eos_token_id": [2, 300]}, "eos_token_id"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"rope_parameters": {"rope_type": "nosuch", "rope_theta": 10000.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "rope_parameters"),
        ({"embedding_multiplier": 0.0}, "embedding_multiplier"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window_layers": [0]}, "sliding_window_layers"),
        ({"sliding_window": 4, "sliding_window_layers": [2]}, "sliding_window_layers"),
        ({"sliding_rope_theta": -1.0}, "sliding_rope_theta"),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        tiny_config(**overrides)


def test_paper_presets_match_the_design_note():
    mla = EGMLAConfig.from_preset("paper-mla-base")
    kv64 = EGMLAConfig.from_preset("paper-egmla-kv64")
    kv16 = EGMLAConfig.from_preset("paper-egmla-kv16")
    for config in (mla, kv64, kv16):
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (12, 768, 12)
        assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (64, 64, 64)
        assert config.vocab_size == 50257
    assert (mla.kv_lora_rank, mla.gate_embedding_dim) == (256, 0)
    assert (kv64.kv_lora_rank, kv64.gate_embedding_dim) == (64, 256)
    assert (kv16.kv_lora_rank, kv16.gate_embedding_dim) == (16, 256)
    # Cached values per token over all layers: 3,840 (MLA-Base) and 1,536 (EG-MLA-kv64), as in the paper.
    assert mla.kv_cache_values_per_token() == 3840
    assert kv64.kv_cache_values_per_token() == 1536
    assert kv16.kv_cache_values_per_token() == 960
    assert EGMLAConfig.from_preset("paper-egmla-kv64", num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="Unknown preset"):
        EGMLAConfig.from_preset("paper-gpt")


def test_config_round_trip(tmp_path):
    config = tiny_config(q_lora_rank=24, rope_key_heads=2, gate_layers_per_table=2, gate_position="latent")
    config.save_pretrained(tmp_path)
    loaded = EGMLAConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.layer_types == [EGMLA_LAYER_TYPE] * 2
    assert loaded.num_gate_tables == 1
    assert loaded.head_dim == loaded.qk_rope_head_dim  # what the rope utilities size the rotary embedding by


def test_legacy_rope_kwargs_are_standardised():
    config = tiny_config(rope_theta=500000.0)
    assert config.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}
