"""EG-MLA model configuration.

Embedding-Gated Multi-head Latent Attention (arXiv 2509.16686): DeepSeek's MLA whose up-projected keys and
values (or whose latent) are multiplied by a gate built from a per-token embedding table. Field names follow
`DeepseekV3Config` wherever the two models share a dimension.

This file is also shipped as Hub remote code: it imports only transformers, torch and huggingface_hub.
"""

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

# The cache layer type registered by `modeling_egmla.EGMLALatentCacheLayer`.
EGMLA_LAYER_TYPE = "egmla_latent_attention"
GATE_POSITIONS = ("kv", "latent")
GATE_NORMS = ("rms", "none")
ROPE_MODES = ("decoupled", "exact")

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
        num_attention_heads: number of query heads (keys and values are expanded to as many heads).
        q_lora_rank: rank of the low-rank query (`q_a_proj` -> norm -> `q_b_proj`); `None` = full-rank `q_proj`.
        kv_lora_rank: width of the cached latent `c_t`; a list gives each layer its own width.
        qk_nope_head_dim: per-head query/key dims without rotary embedding (may be 0).
        qk_rope_head_dim: per-head query/key dims with rotary embedding; the rope key has this width.
        v_head_dim: per-head value dims.
        rope_key_heads: number of rope keys per token; 1 = one shared by all heads (DeepSeek), more = one per
            group of `num_attention_heads // rope_key_heads` query heads.
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
        rope_parameters: transformers rope parameters (`rope_type` default, linear, dynamic, yarn, llama3, ...).
        rope_frequency_dim: rotary width whose frequencies the rope dims use (None = `qk_rope_head_dim`). A model
            retrofitted from Llama keeps the source's `head_dim` here, so its kept pairs rotate exactly as before.
        rope_frequency_indices: per layer, per rope key head, which `qk_rope_head_dim // 2` of the
            `rope_frequency_dim // 2` frequencies its pairs use ([layer][head][pair]; None = the first ones, in
            order; a frequency may serve several pairs, e.g. a rope key shared by heads). Query heads use the
            frequencies of their group's rope key.
        max_position_embeddings: context length the rotary embedding is built for.
        layer_types: cache layer type of every layer; always `"egmla_latent_attention"`.
    """

    model_type = "egmla"
    keys_to_ignore_at_inference = ["cache"]
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 50257
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
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
        if self.layer_types is None:
            self.layer_types = [EGMLA_LAYER_TYPE] * self.num_hidden_layers
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

    def layer_kv_lora_rank(self, layer_idx: int) -> int:
        return self.kv_lora_rank[layer_idx] if isinstance(self.kv_lora_rank, list) else self.kv_lora_rank

    def kv_cache_values_per_token(self) -> int:
        """Cached values per token over all layers: latents plus rope keys (token ids and positions not counted)."""
        return sum(self.layer_kv_lora_rank(i) + self.rope_key_width for i in range(self.num_hidden_layers))

    def validate_architecture(self):
        """Part of `@strict` validation: every rule names its field."""
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "qk_rope_head_dim",
            "v_head_dim",
            "rope_key_heads",
            "gate_layers_per_table",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value}.")
        for name in ("qk_nope_head_dim", "gate_embedding_dim"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value}.")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"`qk_rope_head_dim` must be even (rotary pairs), got {self.qk_rope_head_dim}.")
        ranks = self.kv_lora_rank if isinstance(self.kv_lora_rank, list) else [self.kv_lora_rank]
        if any(rank <= 0 for rank in ranks):
            raise ValueError(f"`kv_lora_rank` must be positive (or a list of positive ranks), got {self.kv_lora_rank}.")
        if isinstance(self.kv_lora_rank, list) and len(self.kv_lora_rank) != self.num_hidden_layers:
            raise ValueError(
                f"`kv_lora_rank` lists {len(self.kv_lora_rank)} ranks for {self.num_hidden_layers} layers."
            )
        self.validate_rope_frequencies()
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"`q_lora_rank` must be None (full-rank query) or positive, got {self.q_lora_rank}.")
        if self.num_attention_heads % self.rope_key_heads:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be divisible by `rope_key_heads` "
                f"({self.rope_key_heads}): each rope key serves an equal group of query heads."
            )
        if self.num_hidden_layers % self.gate_layers_per_table:
            raise ValueError(
                f"`num_hidden_layers` ({self.num_hidden_layers}) must be divisible by `gate_layers_per_table` "
                f"({self.gate_layers_per_table}): every gate table serves an equal group of layers."
            )
        if self.gate_position not in GATE_POSITIONS:
            raise ValueError(f"`gate_position` must be one of {GATE_POSITIONS}, got {self.gate_position!r}.")
        if self.rope_mode not in ROPE_MODES:
            raise ValueError(f"`rope_mode` must be one of {ROPE_MODES}, got {self.rope_mode!r}.")
        if self.rope_mode == "exact" and (self.rope_key_heads != 1 or self.rope_frequency_indices is not None):
            raise ValueError(
                "`rope_mode` 'exact' rotates every head's rebuilt key with the first qk_rope_head_dim // 2 "
                f"frequencies: it takes rope_key_heads=1 and no rope_frequency_indices (got {self.rope_key_heads}, "
                f"{self.rope_frequency_indices})."
            )
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(f"`gate_norm` must be one of {GATE_NORMS}, got {self.gate_norm!r}.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"`hidden_act` {self.hidden_act!r} is not a transformers activation.")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"`rms_norm_eps` must be positive, got {self.rms_norm_eps}.")
        if not 0 <= self.attention_dropout < 1:
            raise ValueError(f"`attention_dropout` must be in [0, 1), got {self.attention_dropout}.")
        if self.initializer_range < 0:
            raise ValueError(f"`initializer_range` must be >= 0, got {self.initializer_range}.")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"`rope_parameters` has rope_type {rope_type!r}, not one of transformers' rope types "
                f"{['default', *ROPE_INIT_FUNCTIONS]}."
            )
        if rope_type != "default" and "factor" not in self.rope_parameters and rope_type != "longrope":
            raise ValueError(f"`rope_parameters` of type {rope_type!r} needs a `factor`.")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is not None and not 0 <= token_id < self.vocab_size:
                    raise ValueError(
                        f"`{name}` must be None or lie in [0, vocab_size={self.vocab_size}), got {token_id}."
                    )

    def validate_rope_frequencies(self):
        frequency_dim = self.rope_frequency_dim or self.qk_rope_head_dim
        if frequency_dim % 2:
            raise ValueError(f"`rope_frequency_dim` must be even, got {frequency_dim}.")
        if self.rope_frequency_indices is None:
            # Without indices the rope pairs take the first frequencies, so there must be enough of them.
            if frequency_dim < self.qk_rope_head_dim:
                raise ValueError(
                    f"`rope_frequency_dim` ({frequency_dim}) must be >= qk_rope_head_dim ({self.qk_rope_head_dim}) "
                    "unless `rope_frequency_indices` says which frequency each pair uses."
                )
            return
        indices = self.rope_frequency_indices
        pairs = self.qk_rope_head_dim // 2
        if len(indices) != self.num_hidden_layers or any(
            len(layer) != self.rope_key_heads or any(len(head) != pairs for head in layer) for layer in indices
        ):
            raise ValueError(
                f"`rope_frequency_indices` must hold, for each of the {self.num_hidden_layers} layers, "
                f"{self.rope_key_heads} lists (one per rope key head) of {pairs} frequency indices, got {indices}."
            )
        if any(not 0 <= index < frequency_dim // 2 for layer in indices for head in layer for index in head):
            raise ValueError(
                f"`rope_frequency_indices` must lie in [0, rope_frequency_dim // 2 = {frequency_dim // 2}), "
                f"got {indices}."
            )

    def to_dict(self) -> dict:
        """As saved: `layer_types` is left out while it is the default (every layer egmla's), so that tools that
        read config.json without egmla (AutoTokenizer, vLLM) do not meet a layer type transformers does not know."""
        output = super().to_dict()
        if output.get("layer_types") == [EGMLA_LAYER_TYPE] * self.num_hidden_layers:
            del output["layer_types"]
        return output

    def validate_layer_type(self):
        """Our cache layer type is not one of transformers' built-in ones, so the base check cannot be used."""
        if self.layer_types is None:
            return
        if any(layer_type != EGMLA_LAYER_TYPE for layer_type in self.layer_types):
            raise ValueError(f"`layer_types` entries must all be {EGMLA_LAYER_TYPE!r}, got {self.layer_types}.")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_types` has {len(self.layer_types)} entries but `num_hidden_layers` is "
                f"{self.num_hidden_layers}."
            )


__all__ = ["EGMLAConfig"]
