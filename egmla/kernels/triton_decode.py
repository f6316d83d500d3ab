"""Triton decode kernels over the latent cache (flash-decoding: each program attends over one split of the cached
positions block by block with an online softmax; the splits are merged by log-sum-exp afterwards).

`decode_kv` (gate on the per-head keys and values, or the RoPE-exact latent) expands every block of cached latents
with W^{UKV}, builds the gate from the gate-table rows (looked up through the per-position index) and W^{UE}, applies
the gate norm, rotates the rebuilt rope dims by their positions ("exact" rope) and attends, so expanded K/V never
reaches main memory. `decode_latent` is the absorbed MQA over `[latent ; rope key]`.
Both take and return what `fused_torch` does (`interface`). Set `TRITON_INTERPRET=1` before importing this module
to run them on the CPU.
"""

import math
import os

import torch
import triton
import triton.language as tl

from .interface import KVDecodeInputs, KVDecodeWeights, LatentDecodeInputs

# Triton's CPU interpreter multiplies bf16/fp16 tiles in tl.dot as raw bits: there, dot operands go to fp32.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def block(width: int) -> int:
    """A power-of-two tile width >= 16 (tl.dot's minimum) covering `width`."""
    return max(16, triton.next_power_of_2(max(width, 1)))


def tile_widths(**widths: int) -> dict[str, int]:
    """The kernels' BLOCK_<NAME> arguments: each width's tile (`block`)."""
    return {f"BLOCK_{name}": block(width) for name, width in widths.items()}


def split_size_for(key_length: int, rows: int, block_t: int, target_programs: int = 264) -> int:
    """Positions per program: enough splits that rows x splits fills the GPU (about two programs per SM)."""
    splits = max(1, min(math.ceil(target_programs / max(rows, 1)), math.ceil(key_length / block_t)))
    return block_t * math.ceil(math.ceil(key_length / splits) / block_t)


def merge_splits(acc: torch.Tensor, running_max: torch.Tensor, running_sum: torch.Tensor) -> torch.Tensor:
    """acc [..., splits, d], running_max/sum [..., splits] -> softmax-weighted output [..., d] (log-sum-exp)."""
    weight = torch.exp(running_max - running_max.max(dim=-1, keepdim=True).values)
    total = (running_sum * weight).sum(dim=-1, keepdim=True)
    return (acc * weight[..., None]).sum(dim=-2) / total


@triton.jit
def _tile(base, first, count, width, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, UPCAST: tl.constexpr):
    """Rows [first, first + count) of a row-major [*, width] matrix as a [BLOCK_ROWS, BLOCK_COLS] tile, zero-padded."""
    i = tl.arange(0, BLOCK_ROWS)
    j = tl.arange(0, BLOCK_COLS)
    inside = (i[:, None] < count) & (j[None, :] < width)
    tile = tl.load(base + (first + i[:, None]) * width + j[None, :], mask=inside, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _vector(base, first, count, BLOCK: tl.constexpr):
    """Elements [first, first + count) of a vector, in fp32, zero-padded to BLOCK."""
    i = tl.arange(0, BLOCK)
    return tl.load(base + first + i, mask=i < count, other=0.0).to(tl.float32)


@triton.jit
def _rebuild(latent, weight, rows, gate_weight, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr):
    """One slice of the rebuilt keys or values of a block of positions: (latent W^T) * (1 + rows G^T)."""
    part = tl.dot(latent, tl.trans(weight), input_precision=PRECISION)
    if HAS_GATE:
        part = part * (1.0 + tl.dot(rows, tl.trans(gate_weight), input_precision=PRECISION))
    return part


@triton.jit
def _positions(base, token, first, count, inside, BLOCK: tl.constexpr):
    """Columns [first, first + count) of a [*, 2 * count] per-position table (cos or sin) for `token` [BLOCK_T]."""
    i = tl.arange(0, BLOCK)
    keep = inside[:, None] & (i[None, :] < count)
    return tl.load(base + token[:, None] * (2 * count) + first + i[None, :], mask=keep, other=0.0).to(tl.float32)


# The kernels' parameters stay positional-or-keyword (Triton compiles keyword-only ones only since 3.9, and a GPU's
# Triton comes with its torch build); every launch names each argument.
@triton.jit
def _decode_kv_kernel(
    query_ptr,  # [B, H, S, DN + DR]
    latent_ptr,  # [B, T, R], rows `latent_row_stride` apart (a view of the cache's [latent ; rope key] rows)
    rope_key_ptr,  # [B, T, HR * DR] (decoupled rope), rows `rope_row_stride` apart
    key_cos_ptr,  # [B, T, DR] (EXACT_ROPE: the rebuilt keys' rope dims turn with their positions)
    key_sin_ptr,  # [B, T, DR]
    gate_rows_ptr,  # [U, DE]
    gate_index_ptr,  # [B, T] the row of each position (GATE_INDEXED), else rows are per position
    kv_weight_ptr,  # [HKV, DK + DV, R], DK = DN (decoupled rope) or DN + DR (EXACT_ROPE)
    gate_weight_ptr,  # [HKV, DK + DV, DE]
    norm_weight_ptr,  # [DK + DV]
    mask_ptr,  # [B, S, T] int8
    key_scale_ptr,  # [B, H, T] float32 (HAS_SCALE: qk_norm, each key's norm scale for each query head)
    acc_ptr,  # [B, H, S, SPLITS, DO]: DO = R (ABSORB_VALUES: the weighted sum of latents) or DV
    max_ptr,  # [B, H, S, SPLITS]
    sum_ptr,  # [B, H, S, SPLITS]
    latent_batch_stride,
    latent_row_stride,
    rope_batch_stride,
    rope_row_stride,
    key_length,
    heads,
    group,  # query heads per key head: H / HKV
    query_length,
    splits,
    split_size,
    scaling,
    norm_eps,
    DN: tl.constexpr,
    DV: tl.constexpr,
    DR: tl.constexpr,
    R: tl.constexpr,
    DE: tl.constexpr,
    HR: tl.constexpr,
    EXACT_ROPE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    GATE_INDEXED: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ABSORB_VALUES: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    DO: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_DN: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DE: tl.constexpr,
    BLOCK_DO: tl.constexpr,
):
    row = tl.program_id(0)  # one (batch, head, query) row
    split = tl.program_id(1)
    b = row // (heads * query_length)
    h = (row // query_length) % heads
    s = row % query_length
    g = h // (heads // HR)  # the rope key this head reads (decoupled rope)
    DH: tl.constexpr = DR // 2  # "exact" rope turns dims j and j + DH together (half-split layout)
    DK: tl.constexpr = DN + DR if EXACT_ROPE else DN  # rebuilt key dims

    rr = tl.arange(0, BLOCK_R)
    de = tl.arange(0, BLOCK_DE)
    q_nope = _vector(query_ptr + row * (DN + DR), 0, DN, BLOCK_DN)
    # This head's slices of W^{UKV} (and W^{UE}) stay in fast memory for the whole split.
    w_base = kv_weight_ptr + (h // group) * (DK + DV) * R
    w_key = _tile(w_base, 0, DN, R, BLOCK_DN, BLOCK_R, UPCAST)
    if ABSORB_VALUES:  # the values are the latents: W^{UV} is applied after the kernel
        w_value = w_key  # placeholder (never read)
    else:
        w_value = _tile(w_base, DK, DV, R, BLOCK_DV, BLOCK_R, UPCAST)
    g_key, g_value = w_key, w_value  # placeholders when the gate is off (never read)
    if HAS_GATE:
        g_base = gate_weight_ptr + (h // group) * (DK + DV) * DE
        g_key = _tile(g_base, 0, DN, DE, BLOCK_DN, BLOCK_DE, UPCAST)
        g_value = _tile(g_base, DK, DV, DE, BLOCK_DV, BLOCK_DE, UPCAST)
    if HAS_NORM:
        n_key = _vector(norm_weight_ptr, 0, DN, BLOCK_DN)
        n_value = _vector(norm_weight_ptr, DK, DV, BLOCK_DV)
    if EXACT_ROPE:  # the rope dims of the rebuilt key, as two halves, so that the rotation pairs them tile by tile
        q_low = _vector(query_ptr + row * (DN + DR), DN, DH, BLOCK_DH)
        q_high = _vector(query_ptr + row * (DN + DR), DN + DH, DH, BLOCK_DH)
        w_low = _tile(w_base, DN, DH, R, BLOCK_DH, BLOCK_R, UPCAST)
        w_high = _tile(w_base, DN + DH, DH, R, BLOCK_DH, BLOCK_R, UPCAST)
        g_low, g_high = w_low, w_high
        if HAS_GATE:
            g_low = _tile(g_base, DN, DH, DE, BLOCK_DH, BLOCK_DE, UPCAST)
            g_high = _tile(g_base, DN + DH, DH, DE, BLOCK_DH, BLOCK_DE, UPCAST)
        if HAS_NORM:
            n_low = _vector(norm_weight_ptr, DN, DH, BLOCK_DH)
            n_high = _vector(norm_weight_ptr, DN + DH, DH, BLOCK_DH)
    else:
        q_rope = _vector(query_ptr + row * (DN + DR), DN, DR, BLOCK_DR)

    running_max = -1e30  # finite, so that a block masked out entirely gives exp(0) * 0, not NaN
    running_sum = 0.0
    acc = tl.zeros([BLOCK_DO], dtype=tl.float32)
    start = split * split_size
    end = tl.minimum(start + split_size, key_length)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        inside = t < end
        token = b * key_length + t
        cached = b * latent_batch_stride + t * latent_row_stride
        latent = tl.load(
            latent_ptr + cached[:, None] + rr[None, :], mask=inside[:, None] & (rr[None, :] < R), other=0.0
        )
        if UPCAST:
            latent = latent.to(tl.float32)
        rows = latent  # placeholder when the gate is off (never read)
        if HAS_GATE:
            gate_row = tl.load(gate_index_ptr + token, mask=inside, other=0) if GATE_INDEXED else token
            rows = tl.load(
                gate_rows_ptr + gate_row[:, None] * DE + de[None, :],
                mask=inside[:, None] & (de[None, :] < DE),
                other=0.0,
            )
            if UPCAST:
                rows = rows.to(tl.float32)
        key = _rebuild(latent, w_key, rows, g_key, HAS_GATE, PRECISION)  # [BLOCK_T, BLOCK_DN]
        if ABSORB_VALUES:  # no gate on the values: the weights sum the latents, W^{UV} is applied after
            value = latent  # [BLOCK_T, BLOCK_R]
        else:
            value = _rebuild(latent, w_value, rows, g_value, HAS_GATE, PRECISION)  # [BLOCK_T, BLOCK_DV]
        square_sum = tl.sum(key * key, axis=1) + tl.sum(value * value, axis=1)
        if EXACT_ROPE:
            low = _rebuild(latent, w_low, rows, g_low, HAS_GATE, PRECISION)  # [BLOCK_T, BLOCK_DH]
            high = _rebuild(latent, w_high, rows, g_high, HAS_GATE, PRECISION)
            square_sum += tl.sum(low * low, axis=1) + tl.sum(high * high, axis=1)
        if HAS_NORM:
            inverse = 1.0 / tl.sqrt(square_sum / (DK + DV) + norm_eps)
            key = key * inverse[:, None] * n_key[None, :]
            value = value * inverse[:, None] * n_value[None, :]
            if EXACT_ROPE:
                low = low * inverse[:, None] * n_low[None, :]
                high = high * inverse[:, None] * n_high[None, :]
        score = tl.sum(key * q_nope[None, :], axis=1)
        if EXACT_ROPE:  # x * cos + rotate_half(x) * sin, rotate_half([low, high]) = [-high, low]
            cos_low = _positions(key_cos_ptr, token, 0, DH, inside, BLOCK_DH)
            cos_high = _positions(key_cos_ptr, token, DH, DH, inside, BLOCK_DH)
            sin_low = _positions(key_sin_ptr, token, 0, DH, inside, BLOCK_DH)
            sin_high = _positions(key_sin_ptr, token, DH, DH, inside, BLOCK_DH)
            turned_low = low * cos_low - high * sin_low
            turned_high = high * cos_high + low * sin_high
            score += tl.sum(turned_low * q_low[None, :], axis=1) + tl.sum(turned_high * q_high[None, :], axis=1)
        else:
            dr = tl.arange(0, BLOCK_DR)
            rope_key = tl.load(
                rope_key_ptr + (b * rope_batch_stride + t * rope_row_stride)[:, None] + g * DR + dr[None, :],
                mask=inside[:, None] & (dr[None, :] < DR),
                other=0.0,
            ).to(tl.float32)
            score += tl.sum(rope_key * q_rope[None, :], axis=1)
        if HAS_SCALE:  # qk_norm: every score of a key times its norm's scale
            score = score * tl.load(key_scale_ptr + (b * heads + h) * key_length + t, mask=inside, other=1.0)
        allowed = tl.load(mask_ptr + (b * query_length + s) * key_length + t, mask=inside, other=0) != 0
        score = tl.where(allowed, score * scaling, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(score, axis=0))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(score - new_max)
        running_sum = running_sum * rescale + tl.sum(probs, axis=0)
        acc = acc * rescale + tl.sum(probs[:, None] * value, axis=0)
        running_max = new_max
    out = row * splits + split
    do = tl.arange(0, BLOCK_DO)
    tl.store(acc_ptr + out * DO + do, acc, mask=do < DO)
    tl.store(max_ptr + out, running_max)
    tl.store(sum_ptr + out, running_sum)


@triton.jit
def _decode_latent_kernel(
    query_latent_ptr,  # [B, M, R], M = H * S rows (row = head * S + query)
    query_rope_ptr,  # [B, M, RW], RW = HR * DR
    latent_ptr,  # [B, T, R], rows `latent_row_stride` apart (a view of the cache's [latent ; rope key] rows)
    rope_key_ptr,  # [B, T, RW], rows `rope_row_stride` apart
    mask_ptr,  # [B, S, T] int8
    key_scale_ptr,  # [B, H, T] float32 (HAS_SCALE: qk_norm, each key's norm scale for each query head)
    acc_ptr,  # [B, M, SPLITS, R]
    max_ptr,  # [B, M, SPLITS]
    sum_ptr,  # [B, M, SPLITS]
    latent_batch_stride,
    latent_row_stride,
    rope_batch_stride,
    rope_row_stride,
    key_length,
    query_length,
    rows,
    row_blocks,
    splits,
    split_size,
    scaling,
    R: tl.constexpr,
    RW: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_RW: tl.constexpr,
):
    program = tl.program_id(0)
    split = tl.program_id(1)
    b = program // row_blocks
    m = (program % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)  # a block of heads x queries: MQA shares K
    row_ok = m < rows
    s = m % query_length
    rr = tl.arange(0, BLOCK_R)
    rw = tl.arange(0, BLOCK_RW)
    q_latent = tl.load(
        query_latent_ptr + (b * rows + m[:, None]) * R + rr[None, :],
        mask=row_ok[:, None] & (rr[None, :] < R),
        other=0.0,
    )
    q_rope = tl.load(
        query_rope_ptr + (b * rows + m[:, None]) * RW + rw[None, :],
        mask=row_ok[:, None] & (rw[None, :] < RW),
        other=0.0,
    )
    if UPCAST:
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    running_max = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    start = split * split_size
    end = tl.minimum(start + split_size, key_length)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        inside = t < end
        cached = b * latent_batch_stride + t * latent_row_stride
        latent = tl.load(
            latent_ptr + cached[:, None] + rr[None, :], mask=inside[:, None] & (rr[None, :] < R), other=0.0
        )
        cached = b * rope_batch_stride + t * rope_row_stride
        rope_key = tl.load(
            rope_key_ptr + cached[:, None] + rw[None, :], mask=inside[:, None] & (rw[None, :] < RW), other=0.0
        )
        if UPCAST:
            latent = latent.to(tl.float32)
            rope_key = rope_key.to(tl.float32)
        score = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        score += tl.dot(q_rope, tl.trans(rope_key), input_precision=PRECISION)  # [BLOCK_M, BLOCK_T]
        if HAS_SCALE:  # qk_norm: every score of a key times its norm's scale, the head's (row m = head * S + s)
            score = score * tl.load(
                key_scale_ptr + (b * (rows // query_length) + m[:, None] // query_length) * key_length + t[None, :],
                mask=row_ok[:, None] & inside[None, :],
                other=1.0,
            )
        allowed = tl.load(
            mask_ptr + (b * query_length + s[:, None]) * key_length + t[None, :],
            mask=row_ok[:, None] & inside[None, :],
            other=0,
        )
        score = tl.where(allowed != 0, score * scaling, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(score, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(score - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(latent.dtype), latent, input_precision=PRECISION)
        running_max = new_max
    out = (b * rows + m) * splits + split
    tl.store(acc_ptr + out[:, None] * R + rr[None, :], acc, mask=row_ok[:, None] & (rr[None, :] < R))
    tl.store(max_ptr + out, running_max, mask=row_ok)
    tl.store(sum_ptr + out, running_sum, mask=row_ok)


def precision(dtype: torch.dtype) -> str:
    """fp32 stays fp32 in tl.dot (tf32 would miss the 1e-4 tolerance); half types use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cache_rows(latent: torch.Tensor, rope_key: torch.Tensor) -> dict:
    """The cache's latent [B, T, R] and rope keys [B, T, W] where they lie (each row contiguous, rows and batches
    strided: views of the cache's [latent ; rope key] rows are read in place, not copied per step)."""
    latent, rope_key = (part if part.stride(-1) == 1 else part.contiguous() for part in (latent, rope_key))
    return {
        "latent_ptr": latent,
        "rope_key_ptr": rope_key,
        "latent_batch_stride": latent.stride(0),
        "latent_row_stride": latent.stride(1),
        "rope_batch_stride": rope_key.stride(0),
        "rope_row_stride": rope_key.stride(1),
    }


def split_buffers(rows: int, splits: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per row and split: the weighted sum [rows, splits, width], the running max and sum [rows, splits]; NaN-filled,
    so that an element a program failed to write poisons the result instead of passing as zero."""
    acc = torch.full((rows, splits, width), float("nan"), device=device, dtype=torch.float32)
    running_max = torch.full((rows, splits), float("nan"), device=device, dtype=torch.float32)
    return acc, running_max, torch.full_like(running_max, float("nan"))


def kv_operands(inputs: KVDecodeInputs, weights: KVDecodeWeights) -> dict:
    """The tensors `_decode_kv_kernel` reads, in the cache's dtype where it multiplies them and contiguous; the
    latent stands in for those a step has not (never read)."""
    latent, dtype = inputs.latent, inputs.latent.dtype
    gated, exact_rope = weights.gate_weight is not None, inputs.key_cos is not None
    return {
        "query_ptr": inputs.query.contiguous(),
        **cache_rows(latent, inputs.rope_key),
        "key_cos_ptr": inputs.key_cos.float().contiguous() if exact_rope else latent,
        "key_sin_ptr": inputs.key_sin.float().contiguous() if exact_rope else latent,
        "gate_rows_ptr": inputs.gate_rows.to(dtype).contiguous() if gated else latent,
        "gate_index_ptr": inputs.gate_index.contiguous() if inputs.gate_index is not None else latent,
        "kv_weight_ptr": weights.kv_weight.to(dtype).contiguous(),
        "gate_weight_ptr": weights.gate_weight.to(dtype).contiguous() if gated else latent,
        "norm_weight_ptr": weights.norm_weight.contiguous() if weights.norm_weight is not None else latent,
        "mask_ptr": inputs.mask.to(torch.int8).contiguous(),
        "key_scale_ptr": inputs.key_scale.contiguous() if inputs.key_scale is not None else latent,
    }


def decode_kv(
    inputs: KVDecodeInputs,
    weights: KVDecodeWeights,
    split_size: int | None = None,
    block_t: int = 32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `fused_torch.decode_kv`; returns [B, S, H, dv] (written into `out` when given)."""
    query, latent, kv_weight, nope_dim = inputs.query, inputs.latent, weights.kv_weight, weights.nope_dim
    batch_size, heads, query_length, qk_dim = query.shape
    key_length, rank = latent.shape[1], latent.shape[2]
    exact_rope = inputs.key_cos is not None
    value_dim = kv_weight.shape[1] - (qk_dim if exact_rope else nope_dim)
    rope_dim, rows = qk_dim - nope_dim, batch_size * heads * query_length
    split_size = split_size or split_size_for(key_length, rows, block_t)
    splits = math.ceil(key_length / split_size)
    out_dim = rank if weights.absorb_values else value_dim  # what the weights sum: the latents, or the rebuilt values
    acc, running_max, running_sum = split_buffers(rows, splits, out_dim, latent.device)
    gate_dim = weights.gate_weight.shape[-1] if weights.gate_weight is not None else 1
    _decode_kv_kernel[(rows, splits)](
        **kv_operands(inputs, weights),
        acc_ptr=acc,
        max_ptr=running_max,
        sum_ptr=running_sum,
        key_length=key_length,
        heads=heads,
        group=heads // kv_weight.shape[0],
        query_length=query_length,
        splits=splits,
        split_size=split_size,
        scaling=weights.scaling,
        norm_eps=weights.norm_eps,
        DN=nope_dim,
        DV=value_dim,
        DR=rope_dim,
        R=rank,
        DE=gate_dim,
        HR=weights.rope_key_heads,
        EXACT_ROPE=exact_rope,
        HAS_GATE=weights.gate_weight is not None,
        GATE_INDEXED=inputs.gate_index is not None,
        HAS_NORM=weights.norm_weight is not None,
        ABSORB_VALUES=weights.absorb_values,
        HAS_SCALE=inputs.key_scale is not None,
        DO=out_dim,
        PRECISION=precision(latent.dtype),
        UPCAST=INTERPRETED,
        BLOCK_T=block_t,
        **tile_widths(DN=nope_dim, DV=value_dim, DR=rope_dim, DH=rope_dim // 2, R=rank, DE=gate_dim, DO=out_dim),
    )
    result = merge_splits(acc, running_max, running_sum).view(batch_size, heads, query_length, out_dim)
    if weights.absorb_values:  # W^{UV} per head, once per query instead of once per cached position
        up_value = kv_weight[:, -value_dim:].float().repeat_interleave(heads // kv_weight.shape[0], dim=0)
        result = torch.einsum("bhsr,hvr->bhsv", result, up_value)
    result = result.transpose(1, 2).to(query.dtype)
    return result if out is None else out.copy_(result)


def decode_latent(
    inputs: LatentDecodeInputs,
    scaling: float,
    split_size: int | None = None,
    block_t: int = 32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `fused_torch.decode_latent`; returns [B, H, S, r] (written into `out` when given)."""
    query_latent, query_rope, latent, rope_key, mask, key_scale = inputs
    batch_size, heads, query_length, rank = query_latent.shape
    key_length, rope_width = latent.shape[1], rope_key.shape[2]
    rows = heads * query_length
    block_m = min(64, block(rows))
    row_blocks = math.ceil(rows / block_m)
    split_size = split_size or split_size_for(key_length, batch_size * row_blocks, block_t)
    splits = math.ceil(key_length / split_size)
    acc = torch.full((batch_size, rows, splits, rank), float("nan"), device=latent.device, dtype=torch.float32)
    running_max = torch.full((batch_size, rows, splits), float("nan"), device=latent.device, dtype=torch.float32)
    running_sum = torch.full_like(running_max, float("nan"))
    _decode_latent_kernel[(batch_size * row_blocks, splits)](
        query_latent_ptr=query_latent.to(latent.dtype).reshape(batch_size, rows, rank).contiguous(),
        query_rope_ptr=query_rope.to(latent.dtype).reshape(batch_size, rows, rope_width).contiguous(),
        **cache_rows(latent, rope_key),
        mask_ptr=mask.to(torch.int8).contiguous(),
        key_scale_ptr=key_scale.contiguous() if key_scale is not None else latent,
        acc_ptr=acc,
        max_ptr=running_max,
        sum_ptr=running_sum,
        key_length=key_length,
        query_length=query_length,
        rows=rows,
        row_blocks=row_blocks,
        splits=splits,
        split_size=split_size,
        scaling=scaling,
        R=rank,
        RW=rope_width,
        HAS_SCALE=key_scale is not None,
        PRECISION=precision(latent.dtype),
        UPCAST=INTERPRETED,
        BLOCK_M=block_m,
        BLOCK_T=block_t,
        **tile_widths(R=rank, RW=rope_width),
    )
    result = merge_splits(acc, running_max, running_sum).view(batch_size, heads, query_length, rank)
    result = result.to(query_latent.dtype)
    if out is None:
        return result
    return out.copy_(result)
