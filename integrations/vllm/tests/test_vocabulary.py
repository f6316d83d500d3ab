"""The plugin speaks egmla's vocabulary: its config declares egmla's fields with egmla's defaults, names egmla's
rules as egmla does (and computes them alike), and builds every vLLM layer with its checkpoint prefix. Runs here,
without vLLM: the plugin's config module imports only transformers and huggingface_hub."""

import ast
import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest

from egmla import EGMLAConfig
from tests.utils import MODES, tiny_config

PLUGIN = Path(__file__).resolve().parents[1] / "egmla_vllm"
SHARED_RULES = (
    "gate_enabled", "absorbs", "rope_key_width", "caches_token_ids", "caches_positions", "key_scale_width",
)  # fmt: skip


def plugin_config_module():
    spec = importlib.util.spec_from_file_location("egmla_vllm_config", PLUGIN / "config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plugin_config_class() -> type:
    return plugin_config_module().EGMLAConfig


def declared_defaults(cls: type) -> dict:
    """The fields the class itself declares (not PreTrainedConfig's), with their defaults."""
    own = cls.__annotations__
    return {field.name: field.default for field in dataclasses.fields(cls) if field.name in own}


def test_the_plugin_declares_egmlas_config_fields_with_egmlas_defaults():
    assert declared_defaults(plugin_config_class()) == declared_defaults(EGMLAConfig)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_plugin_names_and_computes_egmlas_rules_alike(mode):
    ours = tiny_config(**MODES[mode])
    theirs = plugin_config_class()(**{name: getattr(ours, name) for name in declared_defaults(EGMLAConfig)})
    for rule in SHARED_RULES:
        assert getattr(theirs, rule) == getattr(ours, rule), rule
    assert [theirs.layer_kv_lora_rank(i) for i in range(2)] == [ours.layer_kv_lora_rank(i) for i in range(2)]
    assert [theirs.layer_window(i) for i in range(2)] == [ours.layer_window(i) for i in range(2)]


def test_a_config_field_the_plugin_does_not_know_is_refused_by_name():
    """A newer egmla's field would otherwise be set and ignored: every field egmla has is declared (above), any
    other key refused, naming it."""
    config = EGMLAConfig(**tiny_config(**MODES["gemma"]).to_dict())
    plugin_config_class().from_dict(config.to_dict())  # egmla's own config.json (with its bookkeeping) loads
    with pytest.raises(ValueError, match=r"does not serve the config field\(s\) \['attention_sinks'\]"):
        plugin_config_class().from_dict({**config.to_dict(), "attention_sinks": True})


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not served"),
        ({"sliding_window_layers": [0]}, r"sliding_window_layers \(\[0\]\) needs a sliding_window"),
        ({"sliding_window": 4, "sliding_window_layers": [2]}, "layer indices in"),
    ],
)
def test_unserved_values_are_refused_by_name(overrides, refusal):
    """A config.json edited by hand (egmla's own config refuses these too)."""
    module = plugin_config_module()
    fields = {name: getattr(tiny_config(), name) for name in declared_defaults(EGMLAConfig)}
    with pytest.raises(ValueError, match=refusal):
        module.check_servable(module.EGMLAConfig(**{**fields, **overrides}))


def test_every_vllm_layer_is_built_with_its_prefix():
    """vLLM names a layer's weights and quantization by its prefix: every layer the plugin builds passes one."""
    layers = {
        "ReplicatedLinear", "VocabParallelEmbedding", "ParallelLMHead", "MergedColumnParallelLinear", "RowParallelLinear",
        "MLAAttention",
    }  # fmt: skip
    calls = [
        node
        for node in ast.walk(ast.parse((PLUGIN / "model.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in layers
    ]
    assert len(calls) >= 8
    # A call given `**layer` takes its prefix from that dict (RebuildingAttention / MLAAttention's `layer`).
    passed = [{keyword.arg for keyword in call.keywords} for call in calls]
    missing = [
        f"{call.func.id} at line {call.lineno}"
        for call, names in zip(calls, passed, strict=True)
        if not names & {"prefix", None}
    ]
    assert not missing, missing


def plugin_functions(*names: str) -> dict:
    """The plugin's copies of egmla's helpers, taken from its model file (which imports vLLM) and run here."""
    tree = ast.parse((PLUGIN / "model.py").read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace = {"math": math, "EGMLAConfig": EGMLAConfig}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(PLUGIN / "model.py"), "exec"), namespace)
    return {name: namespace[name] for name in names}


# The rotary pairs of each rope key head given by the conversion, and a YaRN rope with DeepSeek's mscale.
RULE_CASES = {
    **{mode: overrides for mode, overrides in MODES.items()},
    "chosen pairs": {"rope_key_heads": 2, "rope_frequency_dim": 16,
                     "rope_frequency_indices": [[[0, 2, 5, 7], [1, 3, 4, 6]], [[7, 1, 0, 2], [6, 5, 4, 3]]]},
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 64}},
}  # fmt: skip


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_the_plugins_copied_helpers_compute_as_egmlas(case):
    """`attention_scaling` and `rotary_dims` are copied into the plugin (it cannot import egmla's model file):
    the copies give egmla's values (egmla's None, or one list for every rope key head, spelt out)."""
    from egmla.modeling_egmla import attention_scaling, rotary_dims

    config = tiny_config(**RULE_CASES[case])
    copies = plugin_functions("attention_scaling", "rotary_dims")
    assert copies["attention_scaling"](config) == pytest.approx(attention_scaling(config), rel=1e-12)
    for layer_idx in range(config.num_hidden_layers):
        ours = rotary_dims(config, layer_idx) or [list(range(config.head_dim))]
        ours = ours * config.rope_key_heads if len(ours) == 1 else ours
        assert copies["rotary_dims"](config, layer_idx) == ours


# What the plugin's attention holds under egmla's `EGMLAAttention` names, and the spellings it must not use.
EGMLA_ATTRIBUTES = ("num_heads", "num_key_value_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "rope_key_heads", "kv_lora_rank", "q_lora_rank", "rebuilt_key_dim", "rope_key_width", "absorbs",
                    "rope_mode", "kv_b_proj", "o_proj", "kv_a_layernorm", "gate_embedding_proj", "gate_norm",
                    "key_norm_heads")  # fmt: skip
OTHER_SPELLINGS = ("nope_dim", "rope_dim", "value_dim", "rope_width", "exact_rope", "key_heads")


def attention_attributes(path: Path, class_name: str) -> set[str]:
    """The `self.NAME` attributes a class of `path` sets."""
    tree = ast.parse(path.read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and getattr(node.value, "id", "") == "self"
    }


def test_the_plugins_attention_keeps_egmlas_attribute_names():
    import egmla.modeling_egmla as modeling

    ours = attention_attributes(Path(modeling.__file__), "EGMLAAttention")
    theirs = attention_attributes(PLUGIN / "model.py", "EGMLAAttention")
    assert set(EGMLA_ATTRIBUTES) <= ours  # the names are egmla's
    assert set(EGMLA_ATTRIBUTES) <= theirs, sorted(set(EGMLA_ATTRIBUTES) - theirs)
    assert not theirs & set(OTHER_SPELLINGS), sorted(theirs & set(OTHER_SPELLINGS))
    assert not attention_attributes(PLUGIN / "attention.py", "AbsorbedAttention") & set(OTHER_SPELLINGS)
