"""The closed form of a model in memory, for the Python API (`convert_llama_to_egmla`) and research: the split search
where the options leave the rope split to it (`search.py`), the plan of the chosen split computed once
(`convert.plan_layers`: budget, rope split and factors per layer), then the model built from the plan
(`convert.build_student`). The conversion commands run the layer pass (`layer_pass.py`) on the same per-layer
functions."""

import dataclasses
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedModel

from ..modeling_egmla import EGMLAForCausalLM
from .calibration import Calibration, LayerStatistics, layer_statistics
from .convert import ConversionOptions, ConversionPlan, build_student, plan_layers
from .layer_source import ModelLayers
from .search import choose_split
from .source import load_llama
from .timing import StageTimes


def plan_conversion(
    source: LlamaForCausalLM, options: ConversionOptions, calibration: Calibration, times: StageTimes | None = None
) -> tuple[ConversionPlan, list[LayerStatistics]]:
    """The plan (with the split search's table where it ran) and the calibration statistics it was made with; the
    seconds of the search, the calibration and the factorization go into `times`."""
    times = times or StageTimes()
    with times.stage("split search") if options.rope_split == "auto" else nullcontext():
        options, candidates, calibration = search_split(source, options, calibration)
    if calibration is None and options.factorization == "activation":
        raise ValueError(
            'factorization="activation" needs calibration: token ids [N, S] or the statistics of calibrate(...).'
        )
    with times.stage("calibration"):
        statistics = layer_statistics(source, calibration)
    with times.stage("factorization"):
        plan = plan_layers(source, options, statistics)
    return dataclasses.replace(plan, candidates=candidates), statistics


def search_split(
    source: LlamaForCausalLM, options: ConversionOptions, calibration: Calibration
) -> tuple[ConversionOptions, list[dict], Calibration]:
    """The options with the split chosen where they leave it to the search ("auto"), its table, and what to
    calibrate on next (the statistics the search's pass collected)."""
    if options.rope_split != "auto":
        return options, [], calibration
    if not isinstance(calibration, torch.Tensor):
        raise ValueError(
            "rope_split='auto' compares candidates on held-out calibration blocks: pass token ids [N, S] as "
            "calibration, or choose rope_split 'shared', 'per_head' or 'exact'."
        )
    statistics = []
    options, candidates = choose_split(
        ModelLayers(source), options, calibration, lambda _, kept: statistics.append(kept)
    )
    return options, candidates, statistics or calibration


def convert_llama_to_egmla(
    source: str | Path | PreTrainedModel, options: ConversionOptions, calibration: Calibration = None
) -> EGMLAForCausalLM:
    """Converts a Llama checkpoint into an EG-MLA model; the source is never modified.

    Args:
        source: a `LlamaForCausalLM`, a local folder, a Hub id, or a `.gguf` file.
        options: what to convert to (`ConversionOptions`).
        calibration: token ids [N, S] to calibrate on, statistics from `calibrate(...)` (to convert several ways
            without recalibrating), or None: rope pairs chosen by weight norms alone, and only
            `factorization="weight"`.
    """
    source = load_llama(source)
    plan, _ = plan_conversion(source, options, calibration)
    return build_student(source, plan)
