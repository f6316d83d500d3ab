"""`egmla convert --stream`: the source read, calibrated, converted and written one layer at a time equals the
whole-model conversion of the same options and calibration blocks, reads no more than one layer of the source at
once, and writes a folder that loads like any other."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from egmla.cli import main
from egmla.conversion import ConversionOptions, convert_llama_to_egmla, load_llama
from egmla.conversion.convert import build_student
from egmla.conversion.fitting_text import TextSettings, layer_wise_inputs, read_calibration_text, recovery_length
from egmla.conversion.layer_source import SourceFiles
from egmla.conversion.plan import plan_conversion
from egmla.conversion.reconstruction import ReconstructionSettings, reconstruct_layers
from egmla.conversion.source import load_tokenizer
from egmla.data import EXCERPT, WIKIPEDIA_HELD_OUT
from egmla.text import (
    document_ids,
    document_perplexity,
    position_buckets,
    read_documents,
    split_documents,
    token_blocks,
)
from tests.utils import TOKENIZER_SIZE, tiny_source, with_tokenizer

FLAGS = ["--train-text", str(EXCERPT), "--calibration-blocks", "8", "--block-size", "64"]
CLOSED_FORM = ["--reconstruction-steps", "0"]
SPLITS = {
    "shared": (["--rope-split", "shared", "--rope-pairs", "4"], {"rope_split": "shared", "rope_pairs": 4}),
    "exact": (["--rope-split", "exact"], {"rope_split": "exact"}),
    "auto": ([], {}),  # the split search's choice, streamed in a pass of its own
    # More pairs than one head's 8 frequencies (as a 1B Llama's quarter, 40 pairs of 32): drawn across KV heads.
    "shared-wide": (["--rope-split", "shared", "--rope-pairs", "12"], {"rope_split": "shared", "rope_pairs": 12}),
}


def sharded_source(folder: Path, family: str) -> Path:
    tiny_source(family, vocab_size=TOKENIZER_SIZE[family]).save_pretrained(
        folder, max_shard_size="100KB"
    )  # several files, an index
    return with_tokenizer(folder)


def calibration_blocks(source: Path) -> torch.Tensor:
    """The blocks the streamed conversion calibrates on: the fitting 90% of the text's documents."""
    documents, _ = split_documents(read_calibration_text(EXCERPT, True), 0.1)
    return token_blocks(load_tokenizer(str(source)), documents, 64)[:8]


def held_out_ids(source: Path) -> list[torch.Tensor]:
    """The documents the conversion scores: the held-out last 10% of the text's, whole up to the source's context."""
    _, held_out = split_documents(read_calibration_text(EXCERPT, True), 0.1)
    context = load_llama(source).config.max_position_embeddings
    return document_ids(load_tokenizer(str(source)), held_out[:100], context)


def assert_scores(report: dict, source: Path, models: dict, rel: float) -> None:
    """The report's held-out scores, overall and by position, are the whole-model scores of `models`."""
    documents = held_out_ids(source)
    edges = position_buckets(load_llama(source).config.max_position_embeddings)
    for name, model in models.items():
        expected = document_perplexity(model, documents, edges)
        assert report["perplexity"][name] == pytest.approx(expected["perplexity"], rel=rel)
        buckets = report["perplexity_by_position"][name]
        assert [row["tokens"] for row in buckets] == [row["tokens"] for row in expected["buckets"]]
        assert [row["perplexity"] for row in buckets] == pytest.approx(
            [row["perplexity"] for row in expected["buckets"]], rel=rel
        )
    assert report["eval_documents"] == len(documents) > 1
    # The general English text (the default extra held-out text), scored as it streamed by too.
    general = document_ids(load_tokenizer(str(source)), read_documents(WIKIPEDIA_HELD_OUT)[:100], edges[-1])
    for name, model in models.items():
        expected = document_perplexity(model, general, edges)["perplexity"]
        assert report["extra_perplexity"][name]["wikipedia_held_out.txt"] == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_streamed_conversion_equals_the_whole_model_one(tmp_path, family, split, monkeypatch):
    source = sharded_source(tmp_path / "src", family)
    read = []
    original = SourceFiles.read
    monkeypatch.setattr(
        SourceFiles, "read", lambda self, *args, **kw: read.append(original(self, *args, **kw)) or read[-1]
    )
    flags, fields = SPLITS[split]
    out = tmp_path / "out"
    main(["convert", str(source), "--out", str(out), "--stream", "--kv-lora-rank", "12", *flags, *FLAGS, *CLOSED_FORM])
    streamed = AutoModelForCausalLM.from_pretrained(out)
    whole = convert_llama_to_egmla(
        load_llama(source), ConversionOptions(kv_lora_rank=12, **fields), calibration_blocks(source)
    )
    input_ids = torch.randint(3, 500, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(input_ids).logits, whole(input_ids).logits, rtol=0, atol=1e-5)
    # The held-out documents scored as the layers streamed by: the whole-model scores of the source and the output.
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    assert_scores(report, source, {"source": load_llama(source), "zero-shot": whole}, rel=1e-5)
    assert report["saved_stage"] == "zero-shot" and report["scoring_autocast"] is None  # "auto": 64 wide, float32
    # Read one group at a time, in each pass (the search's, where it runs, then the conversion's): the embeddings,
    # each decoder layer alone, then the tensors outside the layers.
    passes = 2 if split == "auto" else 1
    assert len(read) == 4 * passes
    for embeddings, *layers, outer in (read[start : start + 4] for start in range(0, len(read), 4)):
        assert list(embeddings) == ["weight"] and len(layers) == 2
        assert all(
            name.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
            for layer in layers
            for name in layer
        )
        assert not any(name.startswith("model.layers.") for name in outer)
    assert report["streamed"] and json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]
    card = (tmp_path / "out" / "README.md").read_text()  # a Hub model card, its cache size the budget's
    sizes = (
        f"{report['budget']['source_values_per_token_per_layer']} -> {report['budget']['values_per_token_per_layer']}"
    )
    assert f"KV values / token / layer (the budget's) | {sizes}" in card and "egmla convert --stream" in card


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_streamed_split_search_scores_and_chooses_as_the_whole_model_one(tmp_path, family):
    """With the split left to the search, a first pass streams the layers for it: every candidate's held-out
    perplexity and the choice are the whole-model search's, and the conversion that follows equals the whole-model
    one (the statistics the search saved, read back)."""
    source = sharded_source(tmp_path / "src", family)
    main(["convert", str(source), "--out", str(tmp_path / "out"), "--stream", "--kv-cut", "0.5", *FLAGS, *CLOSED_FORM])
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    teacher, options = load_llama(source), ConversionOptions(kv_cut=0.5)
    plan, _ = plan_conversion(teacher, options, calibration_blocks(source))
    assert len(report["candidates"]) == len(plan.candidates) == 4  # the source and three rope key widths
    for streamed, whole in zip(report["candidates"], plan.candidates, strict=True):
        assert streamed["candidate"] == whole["candidate"] and streamed.get("chosen") == whole.get("chosen")
        assert streamed["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-5)
        assert streamed["cost"] == whole["cost"]
    assert report["options"]["rope_pairs"] == plan.options.rope_pairs and "split search" in report["stage_seconds"]
    input_ids = torch.randint(3, 500, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        streamed_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "out")(input_ids).logits
        torch.testing.assert_close(streamed_logits, build_student(teacher, plan)(input_ids).logits, rtol=0, atol=1e-5)
    assert not (tmp_path / ".out.resume").exists()  # saved: the statistics and the work folder are gone


def test_both_conversions_score_under_bf16_autocast_where_asked(tmp_path, capsys):
    """--scoring-mixed-precision bf16: the whole-model and the streamed conversions score the held-out documents
    under bfloat16 autocast, as `document_perplexity` does under it, and their reports say so."""
    source = sharded_source(tmp_path / "src", "llama")
    flags = ["--kv-lora-rank", "12", *SPLITS["shared"][0], *FLAGS, *CLOSED_FORM, "--scoring-mixed-precision", "bf16"]
    main(["convert", str(source), "--out", str(tmp_path / "whole"), "--steps", "0", *flags])
    main(["convert", str(source), "--out", str(tmp_path / "streamed"), "--stream", *flags])
    assert capsys.readouterr().out.count("(whole documents, bf16 autocast)") == 4  # the source and the output, twice
    teacher, documents = load_llama(source), held_out_ids(source)
    edges = position_buckets(teacher.config.max_position_embeddings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = document_perplexity(teacher, documents, edges)["perplexity"]
    in_float32 = document_perplexity(teacher, documents, edges)["perplexity"]
    assert expected != in_float32 and expected == pytest.approx(in_float32, rel=2e-2)
    whole = json.loads((tmp_path / "whole" / "conversion_report.json").read_text())
    streamed = json.loads((tmp_path / "streamed" / "conversion_report.json").read_text())
    assert whole["scoring_autocast"] == streamed["scoring_autocast"] == "bf16"
    assert whole["perplexity"]["source"] == pytest.approx(expected, rel=1e-6)
    # Layer by layer, bf16 rounds at other places than the whole model's forward: near, not equal.
    assert streamed["perplexity"]["source"] == pytest.approx(expected, rel=5e-3)
    assert streamed["perplexity"]["zero-shot"] == pytest.approx(whole["perplexity"]["zero-shot"], rel=5e-3)


def test_streaming_refuses_a_job_without_text(tmp_path):
    source = sharded_source(tmp_path / "src", "llama")
    with pytest.raises(SystemExit, match="--stream calibrates on text: give --train-text FILE"):
        main(["convert", str(source), "--out", str(tmp_path / "b"), "--stream", "--kv-cut", "0.5"])  # no text
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(("family", "split"), [("llama", "shared"), ("qwen2", "exact"), ("llama", "auto")])
def test_the_streamed_layer_wise_fit_equals_the_whole_model_one(tmp_path, family, split):
    """Each layer fitted as it streams by, on the source's and the student's streams kept on the host, as
    `reconstruct_layers` fits the whole student."""
    source = sharded_source(tmp_path / "src", family)
    flags, fields = SPLITS[split]
    steps = ["--reconstruction-steps", "20"]
    main(
        [
            "convert",
            str(source),
            "--out",
            str(tmp_path / "out"),
            "--stream",
            "--kv-lora-rank",
            "12",
            *flags,
            *FLAGS,
            *steps,
        ]
    )
    streamed = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    teacher, blocks = load_llama(source), calibration_blocks(source)
    whole = convert_llama_to_egmla(teacher, ConversionOptions(kv_lora_rank=12, **fields), blocks)
    closed_form = copy.deepcopy(whole)
    length = recovery_length(TextSettings(), teacher.config.max_position_embeddings)
    rows = reconstruct_layers(whole, teacher, *layer_wise_inputs(blocks, length, ReconstructionSettings(steps=20)))
    report = json.loads((tmp_path / "out" / "conversion_report.json").read_text())
    streamed_rows = report["reconstruction"]["layers"]
    assert [row["fitted"] for row in streamed_rows] == [row["fitted"] for row in rows] and any(
        row["fitted"] for row in rows
    )
    for streamed_row, row in zip(streamed_rows, rows, strict=True):
        assert streamed_row["after"] == pytest.approx(row["after"], rel=1e-4)
    input_ids = torch.randint(3, 500, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(input_ids).logits, whole(input_ids).logits, rtol=0, atol=1e-4)
        assert (streamed(input_ids).logits - closed_form(input_ids).logits).abs().max() > 1e-3  # the fit moved it
    # Scored as the layers streamed by, the fitted student beside its source (which fitting left as it was).
    assert_scores(report, source, {"source": load_llama(source), "layer-wise": whole}, rel=1e-4)


# The gate on K/V (set by least squares layer by layer) with ranks allocated by energy (every layer's spectrum first).
GATED_ENERGY = ["--gate-embedding-dim", "8", "--gate-position", "kv", "--rank-allocation", "energy"]


@pytest.mark.parametrize(("family", "extra"), [("llama", []), ("qwen2", []), ("qwen3", []), ("gemma3", GATED_ENERGY), ("llama", GATED_ENERGY)])
def test_streamed_and_whole_model_conversions_with_the_same_options_give_equal_weights(tmp_path, family, extra):
    """`egmla convert` of one source with one set of options, the split left to the search: the whole-model
    conversion and the streamed one write the same tensors (in closed form: the whole-model conversion keeps a
    layer-wise fit only where it lowers the loss on blocks held aside, and the layer-wise fits are compared above)."""
    source = sharded_source(tmp_path / "src", family)
    flags = ["--kv-cut", "0.5", *FLAGS, *CLOSED_FORM, "--source-sample-share", "0", *extra]
    main(["convert", str(source), "--out", str(tmp_path / "whole"), "--steps", "0", *flags])
    main(["convert", str(source), "--out", str(tmp_path / "streamed"), "--stream", *flags])
    whole_report = json.loads((tmp_path / "whole" / "conversion_report.json").read_text())
    assert whole_report["candidates"]  # the split was searched
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    streamed = {}
    for shard in sorted((tmp_path / "streamed").glob("*.safetensors")):
        streamed.update(load_file(shard))
    assert set(streamed) == set(whole) - {"lm_head.weight"} or set(streamed) == set(whole)
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, whole[name], rtol=0, atol=1e-5, msg=name)
    streamed_report = json.loads((tmp_path / "streamed" / "conversion_report.json").read_text())
    gates = [report["reconstruction"]["gate"] for report in (whole_report, streamed_report)]
    assert [[row["fitted"] for row in rows] for rows in gates] == [[row["fitted"] for row in gates[0]]] * 2
    ranks = [
        json.loads((tmp_path / name / "config.json").read_text())["kv_lora_rank"] for name in ("whole", "streamed")
    ]
    assert ranks[0] == ranks[1]
    if extra:  # a table fitted per layer, and a rank per layer
        assert len(gates[0]) == 2 and any(row["fitted"] for row in gates[0])
        assert isinstance(ranks[0], list) and len(ranks[0]) == 2


@pytest.mark.parametrize("stream", [True, False])
def test_a_gated_energy_ranked_conversion_interrupted_in_its_layer_pass_resumes_to_an_uninterrupted_one(
    tmp_path, monkeypatch, stream
):
    """The gate on K/V fitted layer by layer and ranks by energy, the layer-wise fit on: stopped after the pass's
    first layer, `--resume` continues from the layer and ranks it saved, and writes what an uninterrupted run
    writes (whole-model and streamed)."""
    import egmla.conversion.layer_pass as layer_pass

    source = sharded_source(tmp_path / "src", "llama")
    flags = ["--kv-cut", "0.5", *FLAGS, "--reconstruction-steps", "5", "--source-sample-share", "0", *GATED_ENERGY]
    flags += ["--stream"] if stream else ["--steps", "0"]
    main(["convert", str(source), "--out", str(tmp_path / "straight"), *flags])
    command = ["convert", str(source), "--out", str(tmp_path / "out"), *flags]
    converted = layer_pass.pass_layer

    def stopped_at_the_second_layer(source, layer_idx, *args):
        if layer_idx == 1:
            raise KeyboardInterrupt
        converted(source, layer_idx, *args)

    monkeypatch.setattr(layer_pass, "pass_layer", stopped_at_the_second_layer)
    with pytest.raises(KeyboardInterrupt):
        main(command)
    assert json.loads((tmp_path / ".out.resume" / "ranks.json").read_text())
    monkeypatch.undo()
    main([*command, "--resume"])
    straight, resumed = {}, {}
    for folder, tensors in (("straight", straight), ("out", resumed)):
        for shard in sorted((tmp_path / folder).glob("*.safetensors")):
            tensors.update(load_file(shard))
    assert straight.keys() == resumed.keys() and any("gate_embeddings" in name for name in straight)
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)
