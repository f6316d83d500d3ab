"""Sources of every accepted family (Llama with or without attention biases, Mistral, Qwen2 with q/k/v biases, Qwen3 with
QK-norm, Gemma 3 with QK-norm, four norms, windowed layers and a scaled embedding) convert exactly at full rank in every
rope mode; windows that do not cover the context (outside Gemma 3) and the QK-norm families not carried are refused by
name."""

import json

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from egmla.cli import main
from egmla.conversion import AttentionShape, ConversionOptions, attention_shape, convert_llama_to_egmla, load_llama
from egmla.conversion.convert import resolve_budget
from egmla.conversion.source import check_family
from tests.utils import (
    GEMMA3,
    SOURCE_FAMILIES,
    TOKENIZER_SIZE,
    assert_same_model,
    tiny_source,
    tiny_values,
    with_tokenizer,
)

# Full rank per mode on the tiny shape (2 KV heads of 16 dims, 64 wide): every pair in the rope keys, so the latent
# holds the values (32 rows); "exact": every key and value row (2 x (16 + 16) = 64).
FULL_RANK = {
    "per_head": {"kv_lora_rank": 32, "rope_pairs": 8, "rope_split": "per_head"},
    "shared": {"kv_lora_rank": 32, "rope_pairs": 16, "rope_split": "shared"},
    "exact": {"kv_lora_rank": 64, "rope_split": "exact"},
}


@pytest.mark.parametrize("mode", FULL_RANK)
@pytest.mark.parametrize("family", ["llama-bias", "mistral", "qwen2", "qwen3", "gemma3"])
def test_a_source_of_each_family_converts_exactly_at_full_rank(family, mode):
    teacher = tiny_source(family)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(teacher, ConversionOptions(**FULL_RANK[mode], gate_embedding_dim=8), calibration)
    assert student.config.attention_bias == (family in ("llama-bias", "qwen2"))
    assert student.config.qk_norm == (family in ("qwen3", "gemma3"))
    assert student.config.sliding_window_layers == ([0] if family == "gemma3" else None)
    input_ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_model(student, teacher, input_ids)



@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_block_whose_output_is_normed_is_fitted_to_the_source_block_on_the_students_own_stream(family):
    """A normed attention output cannot grow to undo the drift of the layers before it (Gemma 3): the layer-wise fit's
    target there is the source's block applied to the student's stream, which an exact conversion already meets
    whatever the drift; elsewhere the target stays the source's stream after the block."""
    import copy
    from dataclasses import replace

    from egmla.conversion.families import layer_rotary
    from egmla.conversion.reconstruction import FittingStreams, ReconstructionSettings, fit_and_advance, student_block

    teacher = tiny_source(family)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    options = ConversionOptions(**FULL_RANK["exact"], gate_embedding_dim=0)
    student = convert_llama_to_egmla(teacher, options, calibration)
    blocks = torch.randint(3, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source = teacher.model.embed_tokens(blocks)
    drifted = source + 0.5 * source.std() * torch.randn(source.shape, generator=torch.Generator().manual_seed(2))
    settings = ReconstructionSettings(steps=1, learning_rate=1e-9, mixed_precision="no")
    assert settings.fits_the_block(teacher.model.layers[1]) == (family == "gemma3")
    rows = {}
    for target in ("stream", "block", "auto"):
        fitting = FittingStreams(blocks, source, drifted.clone(), replace(settings, target=target))
        source_rotary = layer_rotary(teacher.model.rotary_emb, teacher.config, 1)
        block = student_block(copy.deepcopy(student), 1)
        student_rotary = student.model.rotary_of(1)
        rows[target] = fit_and_advance(block, teacher.model.layers[1], fitting, source_rotary, student_rotary)
    assert rows["block"]["before"] < 1e-8 and rows["stream"]["before"] > 0.1
    expected = rows["block" if family == "gemma3" else "stream"]["before"]
    assert rows["auto"]["before"] == pytest.approx(expected, rel=1e-4, abs=1e-8)
    with pytest.raises(ValueError, match=r"target must be one of"):
        ReconstructionSettings(target="source")

def test_a_qwen2_source_keeps_its_biases_where_they_act():
    """The value bias passes the softmax whole (into o_proj's bias); a NoPE key bias is the same for every key of a
    query, so the softmax ignores it; the rope key's bias rotates with it (kv_a_proj's bias)."""
    teacher = tiny_source("qwen2")
    options = ConversionOptions(**FULL_RANK["shared"], gate_embedding_dim=0, factorization="weight")
    student = convert_llama_to_egmla(teacher, options)  # weights only: the bias columns factorized as they are
    source, converted = teacher.model.layers[0].self_attn, student.model.layers[0].self_attn
    value_bias = source.v_proj.bias.view(2, 16).repeat_interleave(4, dim=0).flatten()
    torch.testing.assert_close(converted.o_proj.bias, source.o_proj.weight @ value_bias, rtol=0, atol=1e-5)
    assert converted.kv_a_proj_with_mqa.bias[32:].abs().max() > 0.1  # the rope key's bias
    with torch.no_grad():  # without the bias on o_proj the model would differ
        converted.o_proj.bias.zero_()
        input_ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(1))
        assert (student(input_ids).logits - teacher(input_ids).logits).abs().max() > 1e-2


def test_windows_shorter_than_the_context_and_what_is_not_carried_are_refused_by_name():
    with pytest.raises(ValueError, match="sliding-window attention .sliding_window=32 < max_position_embeddings=128"):
        load_llama(tiny_source("mistral", sliding_window=32))
    with pytest.raises(ValueError, match="sliding-window"):
        load_llama(tiny_source("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0))
    load_llama(tiny_source("mistral", sliding_window=128))  # a window over the whole context changes nothing
    with pytest.raises(ValueError, match="'gemma3'.*QK-norm.*Gemma 3's text model.*not carried yet"):
        check_family("gemma3", "a multimodal Gemma 3")
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        load_llama(tiny_source("gemma3", attn_logit_softcapping=50.0))
    local_yarn = {**GEMMA3["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e4}}  # fmt: skip
    with pytest.raises(ValueError, match="windowed layers use 'linear' rope"):
        load_llama(tiny_source("gemma3", rope_parameters=local_yarn))


def library_default_source(family: str, folder, head_dim: int | None, vocab_size: int = 96):
    """A tiny random source of `family` saved by transformers from a config given only its sizes, every other field
    at the library's default (`head_dim` too, unless given): Qwen2's config then writes no `head_dim` at all. A
    Mistral's default window (4,096 of 131,072 positions) would be refused, so it has none, as Mistral v0.2+."""
    config_class, model_class = SOURCE_FAMILIES[family]
    sizes = {key: tiny_values()[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads")}  # fmt: skip
    sizes.update({"vocab_size": vocab_size}, **({"head_dim": head_dim} if head_dim else {}))
    sizes.update({"sliding_window": None} if family == "mistral" else {})
    torch.manual_seed(0)
    model_class(config_class(**sizes)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("head_dim", [None, 16], ids=["library-head-dim", "explicit-head-dim"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_source_saved_with_its_librarys_defaults_converts_exactly_at_full_rank(family, head_dim, tmp_path):
    folder = library_default_source(family, tmp_path / family, head_dim)
    saved = json.loads((folder / "config.json").read_text())
    if family == "qwen2" and head_dim is None:
        assert "head_dim" not in saved  # what Qwen2 and Qwen2.5 checkpoints look like
    shape = attention_shape(load_llama(folder).config)
    assert shape == AttentionShape(head_dim=head_dim or 64 // 8, query_heads=8, key_heads=2)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    for rope_split in ("shared", "exact"):  # the latent holds every value row, or every key and value row
        exact = rope_split == "exact"
        rank = shape.key_value_values if exact else shape.key_value_values // 2
        pairs = None if exact else rank // 2  # a shared rope key of every pair of every key head
        options = ConversionOptions(kv_lora_rank=rank, rope_pairs=pairs, rope_split=rope_split, gate_embedding_dim=8)
        student = convert_llama_to_egmla(folder, options, calibration)
        input_ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert_same_model(student, load_llama(folder), input_ids)


def test_egmla_convert_takes_a_qwen2_folder_without_head_dim(tmp_path):
    """The command with its default split search (which reads the head size for its candidates), calibration and
    scoring, on a folder as transformers saves a Qwen2."""
    folder = with_tokenizer(library_default_source("qwen2", tmp_path / "qwen2", None, TOKENIZER_SIZE["qwen2"]))
    out = tmp_path / "out"
    main(["convert", str(folder), "--out", str(out), "--kv-cut", "0.5", "--reconstruction-steps", "0", "--steps", "0",
          "--calibration-blocks", "4", "--block-size", "32", "--eval-documents", "2"])  # fmt: skip
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert converted.config.v_head_dim == 8  # hidden_size 64 / 8 heads
    assert converted.config.kv_cache_values_per_token() / converted.config.num_hidden_layers == 16  # half of 2 x 2 x 8


def test_a_biased_qwen3_source_keeps_its_nope_key_bias():
    """Under QK-norm each key's own scale multiplies its NoPE bias's q . b, so the softmax no longer ignores it: the
    split keeps the bias column for the latent to rebuild (a Llama's is dropped)."""
    from egmla.conversion.calibration import calibrate
    from egmla.conversion.convert import factorize_layer

    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    options = ConversionOptions(kv_lora_rank=48, rope_pairs=4, rope_split="per_head")
    kept = {}
    for family in ("llama-bias", "qwen3"):
        teacher = tiny_source(family, **({"attention_bias": True} if family == "qwen3" else {}))
        statistics = calibrate(teacher, calibration)[0]
        inv_freq = teacher.model.rotary_emb.inv_freq.float()
        budget = resolve_budget(teacher.config, options)
        split, _ = factorize_layer(teacher.model.layers[0].self_attn, statistics, inv_freq, budget, options)
        kept[family] = split.nope_key[..., -1].abs().max().item()
    assert kept["llama-bias"] == 0 and kept["qwen3"] > 0.1


def test_a_qwen3_budget_counts_its_key_norm_scales():
    """A cut of the source's K/V values leaves room for the rope keys and one scale per key head beside the
    latent."""
    config = tiny_source("qwen3").config
    budget = resolve_budget(config, ConversionOptions(kv_cut=0.5, rope_pairs=4, rope_split="shared"))
    assert budget.values_per_token_per_layer == 32 and budget.kv_lora_rank == 32 - 8 - 2  # 2 key heads


def test_egmla_convert_of_a_qwen3_folder_counts_its_key_norm_scales(tmp_path):
    """The command on a Qwen3 folder (split search, layer-wise fit): its cut leaves room for the key-norm scales, and
    the report's cache figure, measured on real caches, and its decode cost count them."""
    folder = with_tokenizer(library_default_source("qwen3", tmp_path / "qwen3", 16, TOKENIZER_SIZE["qwen3"]))
    out = tmp_path / "out"
    main(["convert", str(folder), "--out", str(out), "--kv-cut", "0.5", "--reconstruction-steps", "5", "--steps", "0",
          "--calibration-blocks", "4", "--block-size", "32", "--eval-documents", "2"])  # fmt: skip
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert converted.config.qk_norm and converted.config.qk_norm_key_heads == 2
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["kv"]["source"] == 2 * 2 * 16 and report["kv"]["converted"] == 32  # half, the 2 scales included
    assert report["decode"]["arithmetic"]["values_per_token_per_layer"] == 32


def test_egmla_convert_of_a_gemma3_folder_keeps_its_layers_and_windows(tmp_path):
    """The command on a Gemma 3 folder (split search, gate and layer-wise fit, scoring): the saved model carries the
    norms, the embedding scale and the windows with their own RoPE base, and loads back to the same logits; at full
    rank (the budget of every key and value row, "exact") it equals its source."""
    teacher = tiny_source("gemma3", vocab_size=TOKENIZER_SIZE["gemma3"])
    teacher.save_pretrained(tmp_path / "gemma3")
    folder = with_tokenizer(tmp_path / "gemma3")
    out = tmp_path / "out"
    main(["convert", str(folder), "--out", str(out), "--kv-cut", "0.5", "--reconstruction-steps", "5", "--steps", "0",
          "--gate-embedding-dim", "8", "--gate-position", "kv", "--calibration-blocks", "4", "--block-size", "32",
          "--eval-documents", "2", "--license", "gemma"])  # fmt: skip
    assert "subject to the Gemma Terms of Use" in (out / "README.md").read_text()  # the notice its terms ask for
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    config = converted.config
    assert config.sandwich_norms and config.qk_norm and config.embedding_multiplier == 64**0.5
    assert (config.sliding_window, config.sliding_window_layers, config.sliding_rope_theta) == (24, [0], 1e4)
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["kv"]["converted"] == pytest.approx(report["kv"]["source"] / 2)  # both keep windows
    assert report["budget"]["windowed_layers"] == {"layers": [0], "of": 2, "window": 24, "converted": True}
    full = tmp_path / "full"
    main(["convert", str(folder), "--out", str(full), "--kv-lora-rank", "64", "--rope-split", "exact", "--steps", "0",
          "--reconstruction-steps", "0", "--gate-embedding-dim", "0", "--calibration-blocks", "4", "--block-size", "32",
          "--eval-documents", "2"])  # fmt: skip
    input_ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_model(AutoModelForCausalLM.from_pretrained(full).eval(), teacher, input_ids)


QWEN3_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def write_qwen3_gguf(model, path):
    """A Qwen3 model as an unquantized GGUF file, as llama.cpp writes one (q/k rows in their order)."""
    config, weights = model.config, {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    for layer in range(config.num_hidden_layers):
        for ours, theirs in QWEN3_GGUF_NAMES.items():
            writer.add_tensor(f"blk.{layer}.{theirs}.weight", weights[f"model.layers.{layer}.{ours}.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_qwen3_gguf_file_loads_with_its_own_head_dim_and_converts_exactly(tmp_path):
    """transformers maps no `attention.key_length` for Qwen3 GGUF files (its config would take head_dim 128): the
    file's head_dim (16, not hidden_size / heads = 8) is read from it, and the source converts exactly at full rank."""
    teacher = tiny_source("qwen3")
    path = write_qwen3_gguf(teacher, tmp_path / "qwen3.gguf")
    loaded = load_llama(path)
    assert loaded.config.head_dim == 16
    input_ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids).logits, teacher(input_ids).logits, rtol=0, atol=1e-5)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(path, ConversionOptions(**FULL_RANK["shared"], gate_embedding_dim=0), calibration)
    with torch.no_grad():  # (the file names no eos: generate would stop elsewhere than the teacher's)
        torch.testing.assert_close(student(input_ids).logits, teacher(input_ids).logits, rtol=0, atol=1e-4)
