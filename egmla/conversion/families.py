"""What differs between the source families beyond their attention's shape, in one place: Gemma 3's norms scale by
`1 + w` and sit on the attention's and the MLP's outputs too, its windowed layers rotate with their own RoPE base and
attend within a window, its attention scale is `query_pre_attn_scalar ** -0.5` and its embeddings are multiplied by
`sqrt(hidden_size)`. Llama, Mistral, Qwen2 and Qwen3 take every default here."""

import functools

import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

# Gemma 3's layer norms under egmla's names: its `post_attention_layernorm` is on the attention's output, its
# `pre_feedforward_layernorm` before the MLP (egmla's, as Llama's, `post_attention_layernorm`).
GEMMA3_NORMS = {
    "post_attention_layernorm.": "attention_output_norm.",
    "pre_feedforward_layernorm.": "post_attention_layernorm.",
    "post_feedforward_layernorm.": "mlp_output_norm.",
}


def is_gemma3(config) -> bool:
    return config.model_type == "gemma3_text"


def norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """The weight a source RMS norm multiplies by: Gemma 3's is `1 + weight`."""
    weight = norm.weight.detach()
    return weight + 1 if isinstance(norm, Gemma3RMSNorm) else weight


def norm_eps(norm: torch.nn.Module) -> float:
    return norm.eps if isinstance(norm, Gemma3RMSNorm) else norm.variance_epsilon


def embedding_multiplier(config) -> float:
    """What the source multiplies its token embeddings by: Gemma 3's sqrt(D), 1 for the others."""
    return config.hidden_size**0.5 if is_gemma3(config) else 1.0


def scaled_embeddings(config, weight: torch.Tensor) -> torch.Tensor:
    """The token embeddings [V, D] as the source's layers receive them (multiplied in their dtype, as Gemma 3's)."""
    if not is_gemma3(config):
        return weight
    return weight * torch.tensor(embedding_multiplier(config), dtype=weight.dtype)


def layer_type(config, layer_idx: int) -> str | None:
    """A Gemma 3 layer's rotary and mask kind (`sliding_attention` or `full_attention`); None for the others."""
    return config.layer_types[layer_idx] if is_gemma3(config) else None


def layer_rotary(rotary: torch.nn.Module, config, layer_idx: int):
    """The source's rotary embedding as layer `layer_idx` uses it, called as `rotary(x, position_ids)`."""
    kind = layer_type(config, layer_idx)
    return rotary if kind is None else functools.partial(rotary, layer_type=kind)


def rope_parameters(config, layer_idx: int = 0) -> dict:
    """The rope parameters of a layer: Gemma 3 keeps one set per layer kind."""
    kind = layer_type(config, layer_idx)
    return dict(config.rope_parameters if kind is None else config.rope_parameters[kind])


def global_layer(config) -> int:
    """A layer whose rotary is the model's main one (Gemma 3: a full-attention layer)."""
    kinds = getattr(config, "layer_types", None) or []
    return kinds.index("full_attention") if is_gemma3(config) and "full_attention" in kinds else 0


def inv_freq(rotary: torch.nn.Module, config, layer_idx: int) -> torch.Tensor:
    """The rotary frequencies of layer `layer_idx`, float32 on the host."""
    kind = layer_type(config, layer_idx)
    return getattr(rotary, "inv_freq" if kind is None else f"{kind}_inv_freq").float().cpu()


def attention_factor(rotary: torch.nn.Module, config, layer_idx: int) -> float:
    """The factor the rotary scales cos/sin by (YaRN's mscale; 1 for the default rope)."""
    kind = layer_type(config, layer_idx)
    return float(getattr(rotary, "attention_scaling" if kind is None else f"{kind}_attention_scaling"))


def source_window(attention: torch.nn.Module) -> int | None:
    """The window a source or student attention attends within (None: the whole context)."""
    return getattr(attention, "sliding_window", None)


def layer_mask(attention: torch.nn.Module, length: int, dtype: torch.dtype, device, causal: bool = False):
    """The additive mask [1, 1, S, S] of a layer's attention over S tokens: causal within its window; for a layer
    without a window None (SDPA's own causal mask), or with `causal` the causal mask."""
    window = source_window(attention)
    if window is None and not causal:
        return None
    query, key = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None]
    blocked = key > query
    if window is not None:
        blocked |= query - key >= window
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)[
        None, None
    ]


def output_norms(layer: torch.nn.Module) -> tuple:
    """A decoder layer's norms on the attention's and the MLP's outputs (None each where it has none)."""
    if hasattr(layer, "post_feedforward_layernorm"):  # Gemma 3
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return getattr(layer, "attention_output_norm", None), getattr(layer, "mlp_output_norm", None)


def attention_added(layer: torch.nn.Module, attention_output: torch.Tensor) -> torch.Tensor:
    """What a decoder layer's attention adds to the residual stream: its output, normed where the layer norms it."""
    norm = output_norms(layer)[0]
    return attention_output if norm is None else norm(attention_output)


def mlp_block(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A source decoder layer after its attention joined the residual stream `hidden`."""
    if hasattr(layer, "mlp_block"):  # a student layer
        return layer.mlp_block(hidden)
    pre_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    output = layer.mlp(pre_norm(hidden))
    norm = output_norms(layer)[1]
    return hidden + (output if norm is None else norm(output))


def layer_state(config, layer_idx: int, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A source layer's tensors outside its attention under the student's names, each norm's weight as it
    multiplies (`norm_weight`)."""
    prefix, state = f"model.layers.{layer_idx}.", {}
    norms = {name + ".weight": norm_weight(module) for name, module in layer.named_modules() if "norm" in name}
    for name, tensor in layer.state_dict().items():
        if name.startswith("self_attn."):
            continue
        tensor = norms.get(name, tensor)
        for gemma_name, student_name in GEMMA3_NORMS.items() if is_gemma3(config) else ():
            name = student_name + name.removeprefix(gemma_name) if name.startswith(gemma_name) else name
        state[prefix + name] = tensor
    return state


def student_outer(config, outer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors outside the layers (embeddings, final norm, head) under the student's names and weights: Gemma 3's
    final norm multiplies by `1 + weight`."""
    if not is_gemma3(config) or "model.norm.weight" not in outer:
        return outer
    return outer | {"model.norm.weight": outer["model.norm.weight"] + 1}


def student_fields(config) -> dict:
    """The student config's fields that carry a Gemma 3 source's layers; none for the other families."""
    if not is_gemma3(config):
        return {}
    fields = {"sandwich_norms": True, "embedding_multiplier": embedding_multiplier(config)}
    windowed = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    if windowed:
        fields |= {"sliding_window": config.sliding_window, "sliding_window_layers": windowed,
                   "sliding_rope_theta": rope_parameters(config, windowed[0])["rope_theta"]}  # fmt: skip
    return fields


def windowed_layers(student_config) -> dict:
    """The report's record of the windowed layers: converted (the only way egmla takes them), which, and the window."""
    layers = student_config.sliding_window_layers or []
    if not layers:
        return {}
    return {"windowed_layers": {"layers": layers, "of": student_config.num_hidden_layers,
                                "window": student_config.sliding_window, "converted": True}}  # fmt: skip


def hidden_act(config) -> str:
    """The MLP's activation (Gemma 3 names its field `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or config.hidden_act


def check_carried(config) -> None:
    """What of a Gemma 3 source egmla has no form for, refused by name."""
    if not is_gemma3(config):
        return
    refused = {
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "use_bidirectional_attention": config.use_bidirectional_attention or None,
    }
    for name, value in refused.items():
        if value is not None:
            raise ValueError(f"The Gemma 3 source sets {name}={value}, which egmla does not carry; nothing was done.")
    sliding = [kind for kind in config.layer_types if kind == "sliding_attention"]
    local = rope_parameters(config, config.layer_types.index("sliding_attention")) if sliding else {}
    if sliding and local.get("rope_type", "default") != "default":
        raise ValueError(f"The Gemma 3 source's windowed layers use {local['rope_type']!r} rope; egmla carries only the "
                         "default rope there.")  # fmt: skip
