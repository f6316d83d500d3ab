"""The EG-MLA config as vLLM's transformers (5.19) reads it, and what the plugin can serve.

egmla's own `configuration_egmla.py` needs transformers 5.24; this class declares the same fields so that an egmla
folder's `config.json` loads under vLLM without `trust_remote_code`. It checks only what the plugin relies on.
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

# Rope types whose frequencies transformers' rope utilities compute (and that egmla writes).
SERVED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The MLP activations the plugin serves (transformers' names): Llama's, and Gemma's GELU-tanh.
SERVED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Keys (of config.json, or that vLLM passes) that are no field here and carry nothing to serve, besides transformers'
# own config attributes (`PreTrainedConfig`'s fields and properties): bookkeeping, and what egmla derives from its
# fields (recomputed in `__post_init__`). Any other key that is no field is refused by name.
NOT_FIELDS = ("auto_map", "_name_or_path", "tokenizer_class", "head_dim", "qk_head_dim")
EGMLA_LAYER_TYPE = "egmla_latent_attention"
EGMLA_SLIDING_LAYER_TYPE = "egmla_sliding_latent_attention"  # a windowed layer's (its transformers cache keeps the window)


@strict
class EGMLAConfig(PreTrainedConfig):
    """The fields of egmla's `EGMLAConfig` (see its docstring for their meaning)."""

    model_type = "egmla"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 50257
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | list[int] = 64
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64
    rope_key_heads: int = 1
    rope_mode: str = "decoupled"
    gate_embedding_dim: int = 256
    gate_position: str = "kv"
    gate_norm: str = "rms"
    gate_layers_per_table: int = 1
    offload_gate_tables: bool = False
    kv_latent_norm: bool = True
    qk_norm: bool = False
    qk_norm_head_dim: int | None = None
    qk_norm_key_heads: int | None = None
    sandwich_norms: bool = False
    embedding_multiplier: float = 1.0
    sliding_window: int | None = None
    sliding_window_layers: list[int] | None = None
    sliding_rope_theta: float | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    rope_frequency_dim: int | None = None
    rope_frequency_indices: list[list[list[int]]] | None = None
    attention_dropout: float | int = 0.0
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        # A field this plugin does not know (a newer egmla's) would be ignored silently: refuse it by name instead.
        unknown = sorted(key for key in kwargs if key not in NOT_FIELDS and not hasattr(PreTrainedConfig, key))
        if unknown:
            raise ValueError(f"egmla-vllm does not serve the config field(s) {unknown} (a newer egmla's?).")
        # transformers' rope utilities size the rotary embedding from `head_dim` (as in egmla).
        self.head_dim = self.rope_frequency_dim or self.qk_rope_head_dim
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        super().__post_init__(**kwargs)

    def validate_layer_type(self):
        """egmla's cache layer types are not transformers' built-in ones (as in egmla's config): each layer's follows
        from its window."""
        expected = [
            EGMLA_SLIDING_LAYER_TYPE if self.layer_window(i) is not None else EGMLA_LAYER_TYPE
            for i in range(self.num_hidden_layers)
        ]
        if self.layer_types is not None and self.layer_types != expected:
            raise ValueError(f"`layer_types` must be {expected} (one per layer), got {self.layer_types}.")

    @property
    def gate_enabled(self) -> bool:
        return self.gate_embedding_dim > 0

    @property
    def latent_width(self) -> int:
        """The cached latent's width: every layer's latent is zero-padded to the widest (vLLM takes one width)."""
        ranks = self.kv_lora_rank if isinstance(self.kv_lora_rank, list) else [self.kv_lora_rank]
        return max(ranks)

    @property
    def rope_key_width(self) -> int:
        """The cached rope key's width: all `rope_key_heads` rope keys side by side (none in "exact" mode)."""
        return 0 if self.rope_mode == "exact" else self.rope_key_heads * self.qk_rope_head_dim

    @property
    def caches_token_ids(self) -> bool:
        """The gate on K/V: the cache row carries each token's id, to rebuild the gate of past tokens."""
        return self.gate_enabled and self.gate_position == "kv"

    @property
    def caches_positions(self) -> bool:
        return self.rope_mode == "exact"

    @property
    def id_digits(self) -> int:
        """With the gate on K/V, the cache row ends with the token id as base-256 digits (exact in any dtype)."""
        if not self.caches_token_ids:
            return 0
        digits = 1
        while 256**digits < self.vocab_size:
            digits += 1
        return digits

    @property
    def absorbs(self) -> bool:
        """Decode by the absorbed MQA over the latent (vLLM's MLA layer as it is); otherwise every cached latent is
        rebuilt at every step: the gate on K/V, or exact rope."""
        return self.rope_mode == "decoupled" and (self.gate_position == "latent" or not self.gate_enabled)

    @property
    def rebuilt_key_dim(self) -> int:
        """Per head, the key dims rebuilt from the latent: the NoPE dims, and in "exact" mode the rope dims too."""
        return self.qk_nope_head_dim + (self.qk_rope_head_dim if self.rope_mode == "exact" else 0)

    @property
    def key_scale_width(self) -> int:
        """`qk_norm`: each token's key-norm scales cached after its rope keys, one per key-norm head (else 0)."""
        return self.qk_norm_key_heads if self.qk_norm else 0

    @property
    def pytorch_attention(self) -> bool:
        """The plugin's PyTorch attention computes the scores: keys rebuilt from the cache (not `absorbs`),
        scores multiplied per key by its norm scale (`qk_norm`), or windowed layers' masks, which no latent kernel
        of vLLM applies."""
        return not self.absorbs or self.qk_norm or self.windowed

    @property
    def cache_tail_width(self) -> int:
        """Values past the latent in vLLM's paged cache row: the rope keys, the key-norm scales and the token id
        digits (at least one value: vLLM's MLA layer needs a rope key; a RoPE-exact latent without the gate on K/V
        or qk_norm caches a zero)."""
        tail = self.rope_key_width + self.key_scale_width + self.id_digits
        return max(tail, 1)

    @property
    def cache_row_width(self) -> int:
        """Values per token per layer in vLLM's paged cache: [latent ; rope keys ; key-norm scales ; token id
        digits]."""
        return self.latent_width + self.cache_tail_width

    def layer_kv_lora_rank(self, layer_idx: int) -> int:
        return self.kv_lora_rank[layer_idx] if isinstance(self.kv_lora_rank, list) else self.kv_lora_rank

    def layer_window(self, layer_idx: int) -> int | None:
        """The window layer `layer_idx` attends within, None where it sees the whole context (as egmla)."""
        return self.sliding_window if layer_idx in (self.sliding_window_layers or ()) else None

    @property
    def windowed(self) -> bool:
        """Some layer attends within a window: only the plugin's PyTorch attention applies one."""
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))


def check_servable(config: EGMLAConfig) -> None:
    """Refuses, naming the problem, what the plugin cannot serve."""
    for name, within in (("num_key_value_heads", "num_attention_heads"), ("rope_key_heads", "num_key_value_heads")):
        if getattr(config, within) % getattr(config, name):
            raise ValueError(f"egmla-vllm: `{name}` ({getattr(config, name)}) must divide `{within}`.")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in SERVED_ROPE_TYPES:
        raise ValueError(f"egmla-vllm: rope_type {rope_type!r} is not served (served: {SERVED_ROPE_TYPES}).")
    if config.hidden_act not in SERVED_ACTIVATIONS:
        raise ValueError(f"egmla-vllm: hidden_act {config.hidden_act!r} is not served (served: {SERVED_ACTIVATIONS}).")
    if config.qk_norm:
        check_qk_norm(config)
    check_windows(config)
    if config.qk_nope_head_dim <= 0 and config.absorbs:
        raise ValueError("egmla-vllm: qk_nope_head_dim 0 leaves vLLM's absorbed MLA decode no key to absorb.")


def check_qk_norm(config: EGMLAConfig) -> None:
    """What egmla's config requires of `qk_norm` (a folder's config.json may have been edited by hand)."""
    heads, norm_dim = config.qk_norm_key_heads, config.qk_norm_head_dim
    if norm_dim is None or heads is None or config.num_key_value_heads % heads or config.q_lora_rank is not None:
        raise ValueError(
            "egmla-vllm: qk_norm needs qk_norm_head_dim and qk_norm_key_heads (dividing num_key_value_heads "
            f"{config.num_key_value_heads}) and no q_lora_rank; got {norm_dim}, {heads}, {config.q_lora_rank}."
        )


def check_windows(config: EGMLAConfig) -> None:
    """What egmla's config requires of the windowed layers (a folder's config.json may have been edited by hand)."""
    windowed, layers = config.sliding_window_layers, config.num_hidden_layers
    if windowed is not None and (config.sliding_window is None or not all(0 <= i < layers for i in windowed)):
        raise ValueError(
            f"egmla-vllm: sliding_window_layers ({windowed}) needs a sliding_window ({config.sliding_window}) and "
            f"layer indices in [0, num_hidden_layers={layers})."
        )
