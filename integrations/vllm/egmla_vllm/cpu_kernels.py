"""The plugin's own CPU kernel, built by torch's `cpp_extension` on first use (cached in torch's extensions folder):
the decode over the paged latent cache where vLLM's CPU latent kernels do not serve, fp32 (they take bf16 and fp16)
and, in any dtype, the scores times each key's norm scale (`qk_norm`) and windowed layers. Where it cannot be built
(no compiler), `paged_latent_decode` returns False and the caller keeps its PyTorch path; a warning says so once."""

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_latent_decode.cpp"


def cpu_flags() -> str:
    """A digest of this CPU's instruction sets: the build targets them (`-march=native`), so another CPU sharing
    torch's extensions folder builds its own."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor() or platform.machine()
    return hashlib.sha256(flags.encode()).hexdigest()[:12]


@functools.cache
def extension():
    """The built module, or None where the build fails."""
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=f"egmla_vllm_cpu_{cpu_flags()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # noqa: BLE001 - any build failure: the PyTorch path serves instead
        logger.warning(
            "egmla_vllm: the paged latent decode kernel did not build (%s); using PyTorch's SDPA", error
        )
        return None


def paged_latent_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    out: torch.Tensor, scale_column: int = -1, scale_heads: int = 0, window: int = 0,
) -> bool:  # fmt: skip
    """query [B, H, Dq] (fp32) over each request's rows of the paged cache [blocks, block_size, D] (any float dtype),
    read in place, the scores over each row's first Dq columns, times the row's key-norm scale at `scale_column` +
    h // (H / scale_heads) for query head h where `scale_column` >= 0, over its last `window` rows only where
    `window` > 0; writes out [B, H, V] (fp32), each row's first V columns its value. False where the kernel is not
    available."""
    module = extension()
    if module is None:
        return False
    module.paged_latent_decode(query.contiguous(), kv_cache, block_table, seq_lens, scale, out, scale_column,
                               scale_heads, window)  # fmt: skip
    return True
