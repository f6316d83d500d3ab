"""The text a conversion fits on and is judged on: the fitting blocks (the user's, the source's samples, or both
interleaved), the blocks held aside to choose stages, the held-out documents scored whole, and the source's samples
held aside from every stage."""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from ..data import EXCERPT, WIKIPEDIA_HELD_OUT
from ..hub import public_name, text_dataset
from ..options import check_fields, option
from ..precision import MIXED_PRECISIONS, bf16_autocast, uses_bf16
from ..sampling import Sampling, sample_blocks, sample_documents
from ..text import (
    document_ids,
    packed_blocks,
    read_documents,
    split_documents,
    token_blocks,
)
from ..training import FinetuneSettings
from .calibration import FITTED_CONTEXT
from .reconstruction import ReconstructionSettings


@dataclass
class TextSettings:
    """Where fitting and held-out text come from."""

    train_text: Path | None = option(
        None,
        "<|endoftext|>-separated text for calibration and fitting; without it, text is sampled from the source",
        input_file=True,
    )
    eval_text: Path | None = option(
        None, "held-out text (default: the last 10% of the fitting text, or the embedded excerpt)", input_file=True
    )
    block_size: int = option(256, "tokens per block cut from the fitting text", bounds="[2, inf)")
    sampled_block_size: int = option(
        256, "tokens per block sampled from the source when no text is given", bounds="[2, inf)"
    )
    # At the same tokens per step: the fitted length is what a model is good at.
    recovery_block_size: int | None = option(
        None,
        "tokens per recovery block, the fitting blocks packed (default: the source's context, at most 512)",
        bounds="[2, inf)",
    )
    # 32 (8,192 tokens): SmolLM2 converted with the defaults ended nearer its source than with 64, and sooner (the
    # layer-wise fit's passes over every block halve; docs/results.md#behind-the-defaults).
    calibration_blocks: int = option(
        32,
        "blocks of fitting text used to calibrate and to fit layer by layer",
        bounds="[1, inf)",
    )
    sampled_blocks: int = option(
        64, "blocks sampled from the source: the fitting text when no text is given", bounds="[1, inf)"
    )
    sample_temperatures: tuple[float, ...] = option(
        (0.7, 0.85, 1.0), "temperatures the source's samples cycle through, batch by batch", bounds="(0, inf)"
    )
    # Half: kept on the choosing half of the general English excerpt and the source's samples (docs/results.md).
    source_sample_share: float = option(
        0.5,
        "with --train-text, the share of the first fitting blocks (calibration, layer-wise fit, recovery) that are "
        "--sampled-blocks of the source's own text, interleaved with the user's (0: the user's text alone)",
        bounds="[0, 1)",
    )
    replay_samples: bool = option(
        False,
        "recovery replays the source's samples at --source-sample-share through all of the user's text (where its "
        "batches are drawn), not only among the first blocks: nearer the source beyond the text, further on it",
    )
    held_aside_samples: int = option(
        24,
        "samples of the source held aside from every stage: the report's perplexity and KL to the source on them",
        bounds="[0, inf)",
    )
    extra_eval_text: tuple[Path, ...] = option(
        (WIKIPEDIA_HELD_OUT,),
        "more held-out texts, each scored whole and named in the report (default: the embedded general English "
        "excerpt, Wikipedia; give the flag with no file for none)",
        input_file=True,
    )
    eval_blocks: int = option(64, "held-out blocks scored during fine-tuning", bounds="[1, inf)")
    eval_documents: int = option(
        100, "held-out documents scored whole (up to the source's context) for the report", bounds="[1, inf)"
    )
    # bf16 scores faster, its perplexity within rounding of float32's, where the CPU computes bf16 (docs/results.md#behind-the-defaults).
    scoring_mixed_precision: str = option(
        "auto",
        "the held-out documents scored under bfloat16 autocast (auto: where the device computes bfloat16 natively "
        "and the model is 512 wide or more)",
        MIXED_PRECISIONS,
    )
    seed: int = option(0, "of sampling, the gate tables, training")

    def __post_init__(self) -> None:
        self.sample_temperatures, self.extra_eval_text = tuple(self.sample_temperatures), tuple(self.extra_eval_text)
        check_fields(self)
        if not self.sample_temperatures:
            raise ValueError("sample_temperatures (--sample-temperatures) needs at least one temperature.")


MAX_RECOVERY_BLOCK = FITTED_CONTEXT  # the default recovery length: longer blocks cost more than their tokens on a CPU
SELECTION_TOKENS = 4096  # at most: fitting text held aside from every stage, to decide which stages are kept


@dataclass
class TextData:
    fit: torch.Tensor
    recovery: torch.Tensor  # the fitting blocks packed to the recovery length
    selection: torch.Tensor  # fitting text no stage fits on, packed as recovery blocks (never the report's text)
    held_out: torch.Tensor  # blocks [N, block_size], for the evaluations during fine-tuning
    documents: list[torch.Tensor]  # whole held-out documents up to the source's context, for the report
    description: dict = field(default_factory=dict)
    extra_documents: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # more held-out texts, by name
    source_samples: list[torch.Tensor] = field(default_factory=list)  # the source's own, held aside from fitting
    bf16_scoring: bool = False  # the documents scored under bfloat16 autocast


def read_calibration_text(path: Path, holds_out: bool) -> list[str]:
    """The documents of a calibration text, refused by name when there is nothing to fit (or to hold out)."""
    documents = read_documents(path)
    if not documents:
        raise ValueError(f"The calibration text {path} is empty: give documents separated by <|endoftext|>.")
    if holds_out and len(documents) < 2:
        raise ValueError(
            f"The calibration text {path} holds {len(documents)} document: the last 10% of the documents are held "
            "out to measure the conversion, so give several (separated by <|endoftext|>), or --eval-text."
        )
    return documents


def split_train_text(settings: TextSettings) -> tuple[list[str], list[str] | None]:
    """The fitting documents of the calibration text and, without an eval text, its held-out last tenth (None when
    an eval text is given)."""
    documents = read_calibration_text(settings.train_text, settings.eval_text is None)
    if settings.eval_text is not None:
        return documents, None
    return split_documents(documents, 0.1)


def fitting_and_held_out(settings: TextSettings) -> tuple[list[str], list[str], str]:
    """(the fitting documents, the held-out documents, where the held-out ones come from) of a calibration text."""
    documents, held_out = split_train_text(settings)
    if held_out is not None:
        return documents, held_out, f"the last 10% of the documents of {public_name(settings.train_text)}"
    return documents, read_documents(settings.eval_text), public_name(settings.eval_text)


def recovery_length(settings: TextSettings, context: int) -> int:
    """Tokens per recovery block (and per block of the layer-wise fit): as asked, else the source's context up to
    `MAX_RECOVERY_BLOCK`."""
    return settings.recovery_block_size or min(context, MAX_RECOVERY_BLOCK)


def sampling(settings: TextSettings, seed_offset: int = 0) -> Sampling:
    """The settings' sampling of the source; how much to sample is the caller's (`sample_blocks` sizes it)."""
    return Sampling(tokens=0, temperatures=settings.sample_temperatures, seed=settings.seed + seed_offset)


def interleaved(text: torch.Tensor, sampled: torch.Tensor, share: float, replay: bool = False) -> torch.Tensor:
    """Blocks of the user's text with the source's samples among them, `share` of every run of blocks: among the
    first of them until the samples are used up, the rest of the text after; with `replay`, the samples cycled so
    that the share holds through all of the text."""
    order, used_text, used_sampled = [], 0, 0
    while (replay or used_sampled < len(sampled)) and used_text < len(text):
        if used_sampled < share * (used_text + used_sampled + 1):
            order.append(sampled[used_sampled % len(sampled)])
            used_sampled += 1
        else:
            order.append(text[used_text])
            used_text += 1
    return torch.cat([torch.stack(order), text[used_text:]]) if order else text


class FittingText(NamedTuple):
    """The fitting text's blocks [N, S]: the user's (or, data-free, the source's samples), and the source's samples
    mixed in beside a user's text (None without)."""

    blocks: torch.Tensor
    sampled: torch.Tensor | None
    held_out: tuple[list[str], str] | None  # the user's held-out documents and where they are from; None data-free
    description: str


def fitting_blocks(source, tokenizer, settings: TextSettings) -> FittingText:
    """The fitting text: the user's blocks and the source's samples, or (data-free) the samples alone."""
    if settings.train_text is None:
        size, count = settings.sampled_block_size, settings.sampled_blocks
        fit = sample_blocks(source, tokenizer, count, size, sampling(settings))
        temperatures = "/".join(f"{t:g}" for t in settings.sample_temperatures)
        return FittingText(
            fit, None, None, f"{len(fit)} x {size} tokens sampled from the source at {temperatures} (data-free)"
        )
    documents, held_out, eval_source = fitting_and_held_out(settings)
    fit = token_blocks(tokenizer, documents, settings.block_size, source=f"--train-text {settings.train_text}")
    described = public_name(settings.train_text)
    if settings.source_sample_share == 0:
        return FittingText(fit, None, (held_out, eval_source), described)
    sampled = sample_blocks(source, tokenizer, settings.sampled_blocks, settings.block_size, sampling(settings))
    share = settings.source_sample_share
    where = "of the first blocks, replayed through recovery" if settings.replay_samples else "of the first blocks"
    described += f", with {len(sampled)} blocks sampled from the source ({share:.0%} {where})"
    return FittingText(fit, sampled, (held_out, eval_source), described)


def mixed(fitting: FittingText, share: float, replay: bool = False) -> torch.Tensor:
    """The fitting blocks with the source's samples interleaved at `share`, if there are any."""
    if fitting.sampled is None:
        return fitting.blocks
    return interleaved(fitting.blocks, fitting.sampled, share, replay)


def extra_documents(tokenizer, settings: TextSettings, context: int) -> dict[str, list[torch.Tensor]]:
    """Every extra held-out text's documents, whole up to the source's `context`, by the text's name."""
    count = settings.eval_documents
    return {
        public_name(path): document_ids(tokenizer, read_documents(path)[:count], context)
        for path in settings.extra_eval_text
    }


def held_aside_samples(source, tokenizer, settings: TextSettings) -> list[torch.Tensor]:
    """The source's samples no stage fits on (another seed than every fitting sample's), a batch per temperature."""
    count, temperatures = settings.held_aside_samples, len(settings.sample_temperatures)
    if not count:
        return []
    aside = sampling(settings, seed_offset=1_000_003)
    aside = dataclasses.replace(aside, samples=count, batch_size=max(1, -(-count // temperatures)))
    return sample_documents(source, tokenizer, aside)


def prepare_text(source, tokenizer, settings: TextSettings) -> TextData:
    context = source.config.max_position_embeddings
    # The source is sampled under the scoring's autocast: bf16 where the device computes it natively.
    bf16_scoring = uses_bf16(settings.scoring_mixed_precision, source.device, source.config.hidden_size)
    with bf16_autocast(source.device, bf16_scoring):
        fitting = fitting_blocks(source, tokenizer, settings)
        samples = held_aside_samples(source, tokenizer, settings)
    if fitting.held_out is None:
        eval_path = settings.eval_text or EXCERPT
        held_out_documents, eval_source = read_documents(eval_path), public_name(eval_path)
    else:
        held_out_documents, eval_source = fitting.held_out
    named = f"The held-out text ({eval_source})"
    held_out = token_blocks(tokenizer, held_out_documents, settings.block_size, source=named)[: settings.eval_blocks]
    documents = document_ids(tokenizer, held_out_documents[: settings.eval_documents], context)
    extra = extra_documents(tokenizer, settings, context)
    length = recovery_length(settings, context)
    # The last of the user's blocks (the samples' when data-free) decide which stages are kept: no stage fits them.
    blocks = fitting.blocks
    aside = min(-(-SELECTION_TOKENS // blocks.shape[1]), len(blocks) // 8)
    fitting, selection = fitting._replace(blocks=blocks[: len(blocks) - aside]), blocks[len(blocks) - aside :]
    # Calibration and the layer-wise fit take the first blocks, `source_sample_share` of them samples; recovery
    # draws its batches from all of the text, where only `replay_samples` keeps the share.
    fit = mixed(fitting, settings.source_sample_share)
    recovery = packed_blocks(mixed(fitting, settings.source_sample_share, settings.replay_samples), length)
    selection = packed_blocks(selection, length) if aside * blocks.shape[1] >= length else selection
    description = {
        "fit_text": fitting.description,
        "recovery_block_size": recovery.shape[1],
        "eval_text": eval_source,
        "eval_documents": len(documents),
        "eval_tokens": sum(len(document) - 1 for document in documents),
        "eval_context": context,
        "selection_blocks": len(selection),
        "extra_eval_text": {name: len(ids) for name, ids in extra.items()},
        "held_aside_samples": len(samples),
    }
    description["scoring_autocast"] = "bf16" if bf16_scoring else None
    return TextData(
        fit, recovery, selection, held_out, documents, description, extra_documents=extra, source_samples=samples,
        bf16_scoring=bf16_scoring,
    )  # fmt: skip


def held_out_dataset(settings: TextSettings) -> tuple[str, str]:
    """The held-out text as a `model-index` dataset (type, file name)."""
    return text_dataset(settings.eval_text or settings.train_text or EXCERPT)


def recovery_settings(settings: FinetuneSettings, text: TextData) -> FinetuneSettings:
    """`batch_size` counts fitting blocks: packed into longer recovery blocks, a step keeps its tokens."""
    packing = text.recovery.shape[1] // text.fit.shape[1]
    return dataclasses.replace(settings, batch_size=max(1, settings.batch_size // packing))


def layer_wise_inputs(
    calibration: torch.Tensor, length: int, settings: ReconstructionSettings
) -> tuple[torch.Tensor, ReconstructionSettings]:
    """The layer-wise fit sees the calibration blocks packed to the recovery `length` (the distances the model must
    serve), at the same tokens per step."""
    blocks = packed_blocks(calibration, length) if calibration.numel() >= length else calibration
    packing = blocks.shape[1] // calibration.shape[1]
    return blocks, dataclasses.replace(settings, batch_size=max(1, settings.batch_size // packing))
