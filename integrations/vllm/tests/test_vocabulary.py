"""The plugin speaks egmla's vocabulary: its config declares egmla's fields with egmla's defaults, names egmla's
rules as egmla does (and computes them alike), and builds every vLLM layer with its checkpoint prefix. Runs here,
without vLLM: the plugin's config module imports only transformers and huggingface_hub."""

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from egmla import EGMLAConfig
from tests.utils import MODES, tiny_config

PLUGIN = Path(__file__).resolve().parents[1] / "egmla_vllm"
SHARED_RULES = ("gate_enabled", "absorbs", "rope_key_width", "caches_token_ids", "caches_positions")


def plugin_config_class() -> type:
    spec = importlib.util.spec_from_file_location("egmla_vllm_config", PLUGIN / "config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EGMLAConfig


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


def test_every_vllm_layer_is_built_with_its_prefix():
    """vLLM names a layer's weights and quantization by its prefix: every layer the plugin builds passes one."""
    layers = {"ReplicatedLinear", "VocabParallelEmbedding", "ParallelLMHead", "LlamaMLP", "MLAAttention"}
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
