"""Parameter bytes per device with the gate tables resident and offloaded (`offload_gate_tables=True`).

    python benchmarks/model/offload_memory.py                       # the paper's EG-MLA-kv64 (120M + 154M gate rows)
    python benchmarks/model/offload_memory.py --preset paper-egmla-kv16 --device cuda

The model is moved to `--device` (default: cuda when present, else "meta", which stands in for an accelerator:
parameters moved there take no memory, and the bytes they would take are counted the same way).
"""

import argparse

import torch

from egmla import EGMLAConfig, EGMLAForCausalLM
from egmla.measure import parameter_bytes_by_device


def mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="paper-egmla-kv64")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "meta")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    print(f"{args.preset}, {args.dtype}, moved to {args.device}\n")
    print("| gate tables | on the accelerator | in CPU memory | accelerator share |\n|---|---|---|---|")
    for offload in (False, True):
        config = EGMLAConfig.from_preset(args.preset, offload_gate_tables=offload)
        with torch.device("meta"):  # shapes only: the bytes do not depend on the values
            model = EGMLAForCausalLM(config)
        model.to_empty(device="cpu")
        model.to(device=args.device, dtype=dtype)
        sizes = parameter_bytes_by_device(model)
        accelerator = sum(size for device, size in sizes.items() if device != "cpu")
        cpu = sizes.get("cpu", 0)
        label = "offloaded" if offload else "resident"
        print(f"| {label} | {mib(accelerator)} | {mib(cpu)} | {accelerator / (accelerator + cpu):.0%} |")


if __name__ == "__main__":
    main()
