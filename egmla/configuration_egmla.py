"""EG-MLA model configuration.

Embedding-Gated Multi-head Latent Attention (arXiv 2509.16686): DeepSeek's MLA whose up-projected keys and
values (or whose latent) are multiplied by a gate built from a per-token embedding table. Field names follow
`DeepseekV3Config` wherever the two models share a dimension.

This file is also shipped as Hub remote code: it imports only transformers, torch and huggingface_hub.
"""

from typing import Literal, get_args

from huggingface_hub.dataclasses import strict, validated_field
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

# The cache layer types registered by `modeling_egmla.EGMLALatentCacheLayer` and, for the windowed layers,
# `EGMLASlidingLatentCacheLayer`.
EGMLA_LAYER_TYPE = "egmla_latent_attention"
EGMLA_SLIDING_LAYER_TYPE = "egmla_sliding_latent_attention"
GatePosition = Literal["kv", "latent"]
GateNorm = Literal["rms", "none"]
RopeMode = Literal["decoupled", "exact"]
GATE_POSITIONS, GATE_NORMS, ROPE_MODES = get_args(GatePosition), get_args(GateNorm), get_args(RopeMode)


# Single-field rules, declared on the fields below (`validated_field`); each raises with what the value must be.
def positive(value: int) -> None:
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")


def non_negative(value: float) -> None:
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")


def positive_or_none(value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"must be None (full rank) or positive, got {value}")


def even(value: int | None) -> None:
    if value is not None and value % 2:
        raise ValueError(f"must be even (rotary pairs), got {value}")


def positive_ranks(value: int | list[int]) -> None:
    if any(rank <= 0 for rank in (value if isinstance(value, list) else [value])):
        raise ValueError(f"must be positive (or a list of positive ranks), got {value}")


def below_one(value: float) -> None:
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {value}")


def known_rope_type(value: dict | None) -> None:
    rope_type = (value or {}).get("rope_type", "default")
    needs_factor = rope_type not in ("default", "longrope")
    if rope_type != "default" and (rope_type not in ROPE_INIT_FUNCTIONS or needs_factor and "factor" not in value):
        raise ValueError(
            f"must name one of transformers' rope types {['default', *ROPE_INIT_FUNCTIONS]} and, but for default "
            f"and longrope, a `factor`; got {value}"
        )


def activation(value: str) -> None:
    from transformers.activations import ACT2FN  # here, not at the top: it imports accelerate, `import egmla` need not

    if value not in ACT2FN:
        raise ValueError(f"{value!r} is not a transformers activation")


def field_errors_as_value_errors(cls: type) -> type:
    """`strict` raises its own error type for a bad field; the README promises a `ValueError` naming the field."""
    strict_setattr = cls.__setattr__

    def __setattr__(self, name: str, value) -> None:
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            reason = str(error.__cause__).removeprefix(f"Field '{name}' ")
            raise ValueError(f"`{name}` {reason}.") from error

    cls.__setattr__ = __setattr__
    return cls


# The paper's 120M models (design note, section 1): 12 layers, d = 768, 12 heads, GPT-2 vocabulary.
_PAPER_BASE = {
    "vocab_size": 50257,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "rope_key_heads": 1,
    "max_position_embeddings": 2048,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
}
PRESETS: dict[str, dict] = {
    "paper-mla-base": {**_PAPER_BASE, "kv_lora_rank": 256, "gate_embedding_dim": 0},
    "paper-egmla-kv64": {**_PAPER_BASE, "kv_lora_rank": 64, "gate_embedding_dim": 256},
    "paper-egmla-kv16": {**_PAPER_BASE, "kv_lora_rank": 16, "gate_embedding_dim": 256},
}


@field_errors_as_value_errors
@strict
class EGMLAConfig(PreTrainedConfig):
    r"""
    Configuration of an EG-MLA decoder (`EGMLAModel`, `EGMLAForCausalLM`).

    Defaults are the paper's EG-MLA-kv64 model (`EGMLAConfig.from_preset("paper-egmla-kv64")`) without its GPT-2
    token ids: a config of defaults plus any `vocab_size` is valid (the presets set bos/eos 50256).

    Args:
        vocab_size: number of token ids; also the number of rows of every gate table.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: number of query heads.
        num_key_value_heads: number of heads the up-projection `kv_b_proj` rebuilds keys and values for, each
            shared by a group of `num_attention_heads // num_key_value_heads` query heads (GQA); `None` = one per
            query head (DeepSeek). A Llama converted into a rebuilding form keeps its KV heads here, so the decode
            rebuilds keys for them, not for every query head.
        q_lora_rank: rank of the low-rank query (`q_a_proj` -> norm -> `q_b_proj`); `None` = full-rank `q_proj`.
        kv_lora_rank: width of the cached latent `c_t`; a list gives each layer its own width.
        qk_nope_head_dim: per-head query/key dims without rotary embedding (may be 0).
        qk_rope_head_dim: per-head query/key dims with rotary embedding; the rope key has this width.
        v_head_dim: per-head value dims.
        rope_key_heads: number of rope keys per token; 1 = one shared by all heads (DeepSeek), more = one per
            group of `num_attention_heads // rope_key_heads` query heads; it must divide `num_key_value_heads`.
        rope_mode: `"decoupled"` (DeepSeek): a separate rope key of `qk_rope_head_dim` dims is cached beside the
            latent, and keys rebuilt from the latent carry no position. `"exact"`: no rope key; every head's whole
            key ([nope ; rope] dims) is rebuilt from the latent and its rope dims are rotated with each cached
            token's position at every step (the positions are cached, 8 bytes a token), so a model converted from
            Llama keeps its RoPE exactly and the whole cache budget goes to the latent. No absorbed decode.
        gate_embedding_dim: width of the gate tables; 0 turns the gate off, which is plain MLA.
        gate_position: `"kv"` gates the up-projected keys and values (token ids are cached to rebuild the gate
            of past tokens); `"latent"` gates the latent before it is cached (no token ids, absorbed decode).
        gate_norm: `"rms"` normalizes the gated vectors (per head for `"kv"`, over the latent for `"latent"`);
            `"none"` leaves them as they are.
        gate_layers_per_table: how many consecutive layers share one gate table (1 = one table per layer).
        offload_gate_tables: keep the gate tables in CPU memory (pinned when CUDA is present) wherever the rest of
            the model is moved or loaded; each forward moves over only the rows of the distinct tokens it sees.
            Also a load-time option: `from_pretrained(folder, offload_gate_tables=True)`.
        kv_latent_norm: RMSNorm on the latent before caching (DeepSeek's `kv_a_layernorm`).
        qk_norm: the attention of a source whose query and key heads are RMS-normed before RoPE (Qwen3).
            The query is the source's: `q_proj` (`qk_norm_head_dim` per head), its norm `q_norm`, then a per-head
            map `q_head_proj` to the `[nope ; rope]` query. Each key's norm is one scale per token and key head,
            `1 / rms` of the source's key (`k_norm_proj`), taken when the token is written and cached beside its
            rope key (`qk_norm_key_heads` values per token); every score of that key is multiplied by it.
        qk_norm_head_dim: the width each query and key norm acts over (the source's head_dim; with `qk_norm`).
        qk_norm_key_heads: the key heads whose scales are cached (the source's; each serves an equal group of
            `num_key_value_heads`; with `qk_norm`).
        sandwich_norms: RMS norms on the attention's and the MLP's outputs too (`attention_output_norm`,
            `mlp_output_norm`), before each joins the residual stream (Gemma 3's four norms per layer).
        embedding_multiplier: the token embeddings are multiplied by it (Gemma 3: `sqrt(hidden_size)`).
        sliding_window: how many positions a windowed layer attends to: a query at position i sees keys at
            i - sliding_window < j <= i (transformers' convention); None = no windowed layer.
        sliding_window_layers: the layers that attend within `sliding_window` (Gemma 3: five of every six).
        sliding_rope_theta: the RoPE base of the windowed layers (Gemma 3's `rope_local_base_freq`, default rope
            type); None = the same rotary as the other layers.
        attention_bias: biases on the query projection (`q_proj`, or `q_a_proj`), the latent and rope key
            (`kv_a_proj_with_mqa`) and the output (`o_proj`), as DeepSeek-V3's; a Qwen2 source's q/k/v biases are
            converted into them.
        rope_parameters: transformers rope parameters (`rope_type` default, linear, dynamic, yarn, llama3, ...).
        rope_frequency_dim: rotary width whose frequencies the rope dims use (None = `qk_rope_head_dim`). A model
            retrofitted from Llama keeps the source's `head_dim` here, so its kept pairs rotate exactly as before.
        rope_frequency_indices: per layer, per rope key head, which `qk_rope_head_dim // 2` of the
            `rope_frequency_dim // 2` frequencies its pairs use ([layer][head][pair]; None = the first ones, in
            order; a frequency may serve several pairs, e.g. a rope key shared by heads). Query heads use the
            frequencies of their group's rope key.
        max_position_embeddings: context length the rotary embedding is built for.
        layer_types: cache layer type of every layer, set from the others: `"egmla_latent_attention"`, and for the
            windowed layers `"egmla_sliding_latent_attention"` (their cache keeps only the window).
    """

    model_type = "egmla"
    keys_to_ignore_at_inference = ["cache"]
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = validated_field(positive, default=50257)
    hidden_size: int = validated_field(positive, default=768)
    intermediate_size: int = validated_field(positive, default=2048)
    num_hidden_layers: int = validated_field(positive, default=12)
    num_attention_heads: int = validated_field(positive, default=12)
    num_key_value_heads: int | None = validated_field(positive_or_none, default=None)
    q_lora_rank: int | None = validated_field(positive_or_none, default=None)
    kv_lora_rank: int | list[int] = validated_field(positive_ranks, default=64)
    qk_nope_head_dim: int = validated_field(non_negative, default=64)
    qk_rope_head_dim: int = validated_field([positive, even], default=64)
    v_head_dim: int = validated_field(positive, default=64)
    rope_key_heads: int = validated_field(positive, default=1)
    rope_mode: RopeMode = "decoupled"
    gate_embedding_dim: int = validated_field(non_negative, default=256)
    gate_position: GatePosition = "kv"
    gate_norm: GateNorm = "rms"
    gate_layers_per_table: int = validated_field(positive, default=1)
    offload_gate_tables: bool = False
    kv_latent_norm: bool = True
    qk_norm: bool = False
    qk_norm_head_dim: int | None = validated_field(positive_or_none, default=None)
    qk_norm_key_heads: int | None = validated_field(positive_or_none, default=None)
    sandwich_norms: bool = False
    embedding_multiplier: float = validated_field(positive, default=1.0)
    sliding_window: int | None = validated_field(positive_or_none, default=None)
    sliding_window_layers: list[int] | None = None
    sliding_rope_theta: float | None = validated_field(positive_or_none, default=None)
    attention_bias: bool = False
    hidden_act: str = validated_field(activation, default="silu")
    max_position_embeddings: int = validated_field(positive, default=2048)
    initializer_range: float = validated_field(non_negative, default=0.02)
    rms_norm_eps: float = validated_field(positive, default=1e-6)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = validated_field(known_rope_type, default=None)
    rope_frequency_dim: int | None = validated_field(even, default=None)
    rope_frequency_indices: list[list[list[int]]] | None = None
    attention_dropout: float | int = validated_field(below_one, default=0.0)
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = self.cache_layer_types()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        # transformers' rope utilities size the rotary embedding from `head_dim` (as DeepSeek-V3 does).
        self.head_dim = self.rope_frequency_dim or self.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        super().__post_init__(**kwargs)
        # Checked here too so that a bad value raises a plain `ValueError` (strict wraps its validators' errors).
        self.validate_architecture()
        self.validate_layer_type()

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "EGMLAConfig":
        """The paper's models: `paper-mla-base`, `paper-egmla-kv64`, `paper-egmla-kv16` (overrides win)."""
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def gate_enabled(self) -> bool:
        return self.gate_embedding_dim > 0

    @property
    def caches_token_ids(self) -> bool:
        """Token ids are cached only when the gate of past tokens must be rebuilt at every step."""
        return self.gate_enabled and self.gate_position == "kv"

    @property
    def caches_positions(self) -> bool:
        """Positions are cached only when the keys rebuilt from the latent must be rotated at every step."""
        return self.rope_mode == "exact"

    @property
    def rope_key_width(self) -> int:
        """Values of the decoupled rope key(s) cached per token per layer (0 in `"exact"` mode)."""
        return 0 if self.rope_mode == "exact" else self.rope_key_heads * self.qk_rope_head_dim

    @property
    def absorbs(self) -> bool:
        """Decode by the absorbed MQA over the latent: exact where nothing touches K/V after the latent (a decoupled
        rope key, and the gate off or on the latent)."""
        return self.rope_mode == "decoupled" and (self.gate_position == "latent" or not self.gate_enabled)

    @property
    def num_gate_tables(self) -> int:
        return self.num_hidden_layers // self.gate_layers_per_table if self.gate_enabled else 0

    def layer_window(self, layer_idx: int) -> int | None:
        """The window layer `layer_idx` attends within, None where it sees the whole context."""
        return self.sliding_window if layer_idx in (self.sliding_window_layers or ()) else None

    def layer_kv_lora_rank(self, layer_idx: int) -> int:
        return self.kv_lora_rank[layer_idx] if isinstance(self.kv_lora_rank, list) else self.kv_lora_rank

    @property
    def key_scale_width(self) -> int:
        """Key-norm scales cached per token per layer (`qk_norm`: one per key head of the source; else 0)."""
        return self.qk_norm_key_heads if self.qk_norm else 0

    def kv_cache_values_per_token(self) -> int:
        """Cached values per token over all layers: latents, rope keys and key-norm scales (token ids and positions
        not counted)."""
        width = self.rope_key_width + self.key_scale_width
        return sum(self.layer_kv_lora_rank(i) + width for i in range(self.num_hidden_layers))

    def validate_architecture(self):
        """The rules between fields (each field's own rule is declared on it); every error names its fields."""
        layers, ranks, indices = self.num_hidden_layers, self.kv_lora_rank, self.rope_frequency_indices
        frequencies, pairs = self.rope_frequency_dim or self.qk_rope_head_dim, self.qk_rope_head_dim // 2
        require(
            not isinstance(ranks, list) or len(ranks) == layers, f"`kv_lora_rank` lists {ranks} for {layers} layers."
        )
        # Each key head, rope key and gate table serves an equal group of query heads, key heads or layers.
        groups = (("num_key_value_heads", "num_attention_heads"), ("rope_key_heads", "num_key_value_heads"),
                  ("gate_layers_per_table", "num_hidden_layers"))  # fmt: skip
        for part, whole in groups:
            part_value, whole_value = getattr(self, part), getattr(self, whole)
            require(whole_value % part_value == 0, f"`{part}` ({part_value}) must divide `{whole}` ({whole_value}).")
        require(
            self.rope_mode != "exact" or (self.rope_key_heads == 1 and indices is None),
            "`rope_mode` 'exact' rotates every rebuilt key with the first frequencies: it takes rope_key_heads=1 and "
            f"no rope_frequency_indices (got {self.rope_key_heads}, {indices}).",
        )
        require(
            indices is not None or frequencies >= self.qk_rope_head_dim,  # the pairs take the first frequencies
            f"`rope_frequency_dim` ({frequencies}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim}) unless "
            "`rope_frequency_indices` says which frequency each pair uses.",
        )
        require(
            indices is None
            or (
                [[len(head) for head in layer] for layer in indices] == [[pairs] * self.rope_key_heads] * layers
                and all(0 <= i < frequencies // 2 for layer in indices for head in layer for i in head)
            ),
            f"`rope_frequency_indices` must hold, for each of the {layers} layers and {self.rope_key_heads} rope keys, "
            f"{pairs} frequency indices in [0, rope_frequency_dim // 2 = {frequencies // 2}), got {indices}.",
        )
        require(
            not self.qk_norm
            or (
                self.qk_norm_head_dim is not None
                and self.qk_norm_key_heads is not None
                and self.num_key_value_heads % self.qk_norm_key_heads == 0
                and self.q_lora_rank is None
            ),
            "`qk_norm` needs `qk_norm_head_dim` and `qk_norm_key_heads` (dividing `num_key_value_heads` "
            f"{self.num_key_value_heads}) and no `q_lora_rank`; got {self.qk_norm_head_dim}, {self.qk_norm_key_heads}, "
            f"{self.q_lora_rank}.",
        )
        windowed = self.sliding_window_layers
        require(
            windowed is None
            or (self.sliding_window is not None and all(0 <= index < layers for index in windowed)),
            f"`sliding_window_layers` ({windowed}) needs a `sliding_window` ({self.sliding_window}) and layer indices "
            f"in [0, num_hidden_layers={layers}).",
        )
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            valid = all(token_id is None or 0 <= token_id < self.vocab_size for token_id in _as_list(value))
            require(valid, f"`{name}` must be None or lie in [0, vocab_size={self.vocab_size}), got {value}.")

    def to_dict(self) -> dict:
        """As saved: `layer_types` is left out while it is the default (every layer egmla's), so that tools that
        read config.json without egmla (AutoTokenizer, vLLM) do not meet a layer type transformers does not know."""
        output = super().to_dict()
        if output.get("layer_types") == self.cache_layer_types():
            del output["layer_types"]
        return output

    def cache_layer_types(self) -> list[str]:
        """Each layer's cache layer type: the windowed layers' keeps their window only."""
        return [
            EGMLA_SLIDING_LAYER_TYPE if self.layer_window(i) is not None else EGMLA_LAYER_TYPE
            for i in range(self.num_hidden_layers)
        ]

    def validate_layer_type(self):
        """Our cache layer types are not transformers' built-in ones, so the base check cannot be used."""
        if self.layer_types is not None and self.layer_types != self.cache_layer_types():
            raise ValueError(
                f"`layer_types` must be {self.cache_layer_types()} (one per layer, `num_hidden_layers`, the windowed "
                f"layers' {EGMLA_SLIDING_LAYER_TYPE!r}), got {self.layer_types}."
            )


def require(condition: bool, message: str) -> None:
    """A rule between fields: a `ValueError` with `message` (naming the fields) where it does not hold."""
    if not condition:
        raise ValueError(message)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


__all__ = ["EGMLAConfig"]
