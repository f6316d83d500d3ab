"""Retrofitting Llama checkpoints into EG-MLA: loading the source (`source`), calibration, partial RoPE (`rope`),
low-rank factorization, the conversion itself (`convert`), and the jobs behind the CLI (`pipeline`)."""

from .calibration import LayerStatistics, calibrate
from .convert import Budget, ConversionOptions, ConversionPlan, build_student, kv_lora_rank_for_cut, resolve_budget
from .plan import convert_llama_to_egmla, plan_conversion
from .source import AttentionShape, attention_shape, load_llama, load_tokenizer

__all__ = [
    "AttentionShape",
    "Budget",
    "ConversionOptions",
    "ConversionPlan",
    "LayerStatistics",
    "attention_shape",
    "build_student",
    "calibrate",
    "convert_llama_to_egmla",
    "kv_lora_rank_for_cut",
    "load_llama",
    "load_tokenizer",
    "plan_conversion",
    "resolve_budget",
]
