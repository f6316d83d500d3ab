"""What a conversion costs as the source grows: random-weight Llamas of real shapes, each converted with the
defaults (`egmla convert --kv-cut 0.6875 --train-text TEXT`) in its own process, its wall time per stage (from the
report) and its peak resident memory (from the OS, `wait4`), one row per shape.

    python benchmarks/conversion/conversion_scale.py --shapes smollm2-135m llama-3.2-1b --layers 2 \
        --text ../shared/assets/text/tinystories_train_2MiB.txt
    python benchmarks/conversion/conversion_scale.py --shapes llama-3.1-8b --dtype bfloat16 --text TEXT \
        -- --stream --calibration-blocks 8 --reconstruction-steps 0

`--layers N` keeps the first N layers of each shape (the per-layer cost times the depth extrapolates the whole);
`--closed-form` skips the split search, the layer-wise fit and the recovery (a shared rope key of head_dim / 4
pairs). The checkpoints are written in `--dtype` (float32 by default) with the SmolLM2 tokenizer (its 49,152 ids fit
every real vocabulary here); extra flags after `--` go to `egmla convert` as they are.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (hidden, layers, query heads, KV heads, MLP width, vocabulary, tied embeddings), as their configs on the Hub.
SHAPES = {
    "tiny": (64, 2, 8, 2, 128, 512, True),  # the suite's shape: seconds
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256, True),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256, False),
}
CLOSED_FORM = ["--rope-split", "shared", "--reconstruction-steps", "0", "--steps", "0"]
MAKE_SOURCE = """
import json, sys, torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
folder, (hidden, layers, heads, key_heads, mlp, vocab, tied), dtype = sys.argv[1], map(int, sys.argv[2:9]), sys.argv[9]
config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     num_key_value_heads=key_heads, intermediate_size=mlp, vocab_size=vocab,
                     tie_word_embeddings=bool(tied), max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, dtype=dtype)
config.architectures = ["LlamaForCausalLM"]
config.save_pretrained(folder)
torch.manual_seed(0)
def random(shape):  # matrices N(0, 0.02), norm weights 1
    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
    return tensor.normal_(0.0, 0.02) if len(shape) > 1 else tensor.fill_(1.0)
with torch.device("meta"):
    layer_shapes = {name: tuple(tensor.shape) for name, tensor in LlamaDecoderLayer(config, 0).state_dict().items()}
# Shapes first, tensors made one shard at a time as it is written: an 8B shape never has to fit in memory whole.
shards = {f"model-layer-{i:05d}.safetensors": {f"model.layers.{i}.{name}": shape for name, shape in
          layer_shapes.items()} for i in range(layers)}
shards["model-outer.safetensors"] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                     **({} if tied else {"lm_head.weight": (vocab, hidden)})}
weight_map, total = {}, 0
for file, shapes in shards.items():
    tensors = {name: random(shape) for name, shape in shapes.items()}
    save_file(tensors, f"{folder}/{file}", metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, file))
    total += sum(tensor.nbytes for tensor in tensors.values())
    del tensors
index = {"metadata": {"total_size": total}, "weight_map": weight_map}
open(f"{folder}/model.safetensors.index.json", "w").write(json.dumps(index, indent=2))
"""


def make_source(folder: Path, shape: tuple, layers: int | None, dtype: str, tokenizer: Path) -> float:
    """Writes a random-weight Llama of `shape` (its first `layers` layers) with the tokenizer; returns its GB."""
    values = list(shape)
    values[1] = min(layers or values[1], values[1])
    arguments = [str(folder), *map(str, values[:6]), str(int(values[6])), dtype]
    subprocess.run([sys.executable, "-c", MAKE_SOURCE, *arguments], check=True)
    for path in tokenizer.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) / 1e9


def tokenizer_for(shape: tuple, scratch: Path) -> Path:
    """SmolLM2's tokenizer (49,152 ids), or stories260K's (512) for a smaller vocabulary, saved once."""
    from egmla.conversion import load_tokenizer
    from egmla.data import TOKENIZER, smollm2_gguf

    if shape[5] < 49152:
        return TOKENIZER
    folder = scratch / "smollm2-tokenizer"
    if not folder.exists():
        load_tokenizer(smollm2_gguf()).save_pretrained(folder)
    return folder


def convert(source: Path, out: Path, flags: list[str], log: Path | None = None) -> dict:
    """One `egmla convert` in a child process: its report and its peak RSS in GB (the OS's count for that child);
    with `log`, the child's output and progress bars go there (else they are dropped)."""
    command = [
        sys.executable,
        "-m",
        "egmla.cli",
        "convert",
        str(source),
        "--out",
        str(out),
        "--kv-cut",
        "0.6875",
        *flags,
    ]
    started = time.perf_counter()
    with open(log or os.devnull, "a") as output:
        environment = os.environ if log else {**os.environ, "TQDM_DISABLE": "1"}
        child = subprocess.Popen(command, stdout=output, stderr=output if log else None, env=environment)
        _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        raise RuntimeError(f"egmla convert failed on {source} (status {status}): {' '.join(command)}")
    report = json.loads((out / "conversion_report.json").read_text())
    return {"wall_s": time.perf_counter() - started, "peak_rss_gb": usage.ru_maxrss / 1e6, "report": report}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["smollm2-135m", "llama-3.2-1b"])
    parser.add_argument("--layers", type=int, default=None, help="the first N layers of each shape (default: all)")
    parser.add_argument("--text", type=Path, required=True, help="fitting and held-out text (--train-text)")
    parser.add_argument("--closed-form", action="store_true", help="no split search, layer-wise fit or recovery")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--log", type=Path, default=None, help="append each conversion's output and progress here")
    parser.add_argument("convert_flags", nargs="*", help="after --: more `egmla convert` flags")
    args = parser.parse_args(argv)
    flags = ["--train-text", str(args.text), "--dtype", args.dtype, *(CLOSED_FORM if args.closed_form else [])]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for name in args.shapes:
            source = scratch / name
            gigabytes = make_source(source, SHAPES[name], args.layers, args.dtype, tokenizer_for(SHAPES[name], scratch))
            result = convert(source, scratch / f"{name}-egmla", flags + args.convert_flags, args.log)
            rows.append(row(name, gigabytes, result, result["report"]["budget"]))
    print_rows(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def row(name: str, gigabytes: float, result: dict, budget: dict) -> dict:
    return {
        "shape": name,
        "checkpoint_gb": round(gigabytes, 4),
        "kv_lora_rank": budget["kv_lora_rank"],
        "streamed": result["report"].get("streamed", False),
        "wall_s": round(result["wall_s"], 1),
        "stage_seconds": result["report"]["stage_seconds"],
        "peak_rss_gb": round(result["peak_rss_gb"], 2),
        "rss_per_checkpoint": round(result["peak_rss_gb"] / gigabytes, 2),
        # what the conversion's memory check predicted before its long stages (`egmla/conversion/memory.py`)
        "predicted_peak_gb": result["report"].get("memory", {}).get("predicted_peak_gb"),
    }


def print_rows(rows: list[dict], args: argparse.Namespace) -> None:
    kind = "streamed" if "--stream" in args.convert_flags else "closed form" if args.closed_form else "defaults"
    extra = f", {' '.join(args.convert_flags)}" if args.convert_flags else ""
    print(f"\n{kind}, {args.layers or 'all'} layers, {args.dtype}{extra} (wall s, peak RSS GB from the OS)")
    print("| shape | checkpoint GB | wall s | peak RSS GB | RSS / checkpoint | seconds by stage |")
    print("|---|---|---|---|---|---|")
    for entry in rows:
        stages = ", ".join(f"{stage} {seconds:g}" for stage, seconds in entry["stage_seconds"].items())
        print(
            f"| {entry['shape']} | {entry['checkpoint_gb']:.2f} | {entry['wall_s']:.0f} | {entry['peak_rss_gb']:.2f} "
            f"| {entry['rss_per_checkpoint']:.1f}x | {stages} |"
        )


if __name__ == "__main__":
    main()
