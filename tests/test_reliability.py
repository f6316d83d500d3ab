"""What transformers' conventions expect of a model and a user meets first: vocabulary resizing with the gate
tables, configs from defaults, and loading the folders we write without egmla installed."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from egmla import EGMLAConfig, EGMLAForCausalLM
from egmla.cli import main
from tests.utils import tiny_llama, tiny_model

TOKENIZER = Path(__file__).resolve().parents[1] / "egmla" / "data" / "stories260K-tokenizer"
GATE_MODES = {"off": dict(gate_embedding_dim=0), "kv": dict(gate_position="kv"), "latent": dict(gate_position="latent")}


@pytest.mark.parametrize("mode", list(GATE_MODES))
@pytest.mark.parametrize("mean_resizing", [True, False])
def test_resizing_the_vocabulary_resizes_every_gate_table(tmp_path, mode, mean_resizing):
    model = tiny_model(**GATE_MODES[mode], gate_layers_per_table=1).eval()
    old_ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(old_ids).logits
    model.resize_token_embeddings(140, mean_resizing=mean_resizing)
    assert model.config.vocab_size == 140
    for table in model.model.gate_embeddings:
        assert table.num_embeddings == 140
        assert table.weight[128:].count_nonzero() == 0  # new tokens: the identity gate 1 + W^{UE} 0
    new_ids = torch.cat([old_ids, torch.tensor([[139], [130]])], dim=1)
    with torch.no_grad():
        grown = model(new_ids).logits  # no IndexError on the new ids
        torch.testing.assert_close(grown[:, :7, :128], before)  # the old tokens' predictions are unchanged
        model.generate(new_ids, max_new_tokens=3, do_sample=False)
    model.save_pretrained(tmp_path / "grown")
    reloaded = EGMLAForCausalLM.from_pretrained(tmp_path / "grown").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(new_ids).logits, grown)

    reloaded.resize_token_embeddings(100)
    reloaded.save_pretrained(tmp_path / "shrunk")
    shrunk = EGMLAForCausalLM.from_pretrained(tmp_path / "shrunk").eval()
    assert shrunk.config.vocab_size == 100
    assert all(table.num_embeddings == 100 for table in shrunk.model.gate_embeddings)
    ids = old_ids.clamp(max=99)
    with torch.no_grad():
        torch.testing.assert_close(shrunk(ids).logits, reloaded(ids).logits)
    with pytest.raises(ValueError, match="vocab_size=100"):
        shrunk(torch.tensor([[120]]))


def test_resized_offloaded_gate_tables_stay_in_cpu_memory():
    model = tiny_model(gate_position="kv", offload_gate_tables=True)
    model.resize_token_embeddings(150)
    for table in model.model.gate_embeddings:
        assert table.offload and table.weight.device.type == "cpu" and table.num_embeddings == 150
    model.to("meta")  # stands in for an accelerator: the tables stay in CPU memory
    assert all(table.weight.device.type == "cpu" for table in model.model.gate_embeddings)


def test_a_config_of_defaults_and_any_vocabulary_is_valid():
    for vocab_size in (32000, 512, 100_000):
        config = EGMLAConfig(vocab_size=vocab_size)
        assert config.bos_token_id is None and config.eos_token_id is None
    assert EGMLAConfig.from_preset("paper-egmla-kv64").eos_token_id == 50256  # the presets keep GPT-2's ids
    with pytest.raises(ValueError, match="bos_token_id"):
        EGMLAConfig(vocab_size=32000, bos_token_id=50256)  # an explicit id outside the vocabulary


def write_folders(tmp_path: Path) -> dict[str, Path]:
    """One folder of each kind we write: save_pretrained (with a tokenizer beside it), egmla convert, quickstart."""
    saved = tmp_path / "saved"
    tiny_model(vocab_size=512, gate_position="kv").save_pretrained(saved)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, saved / name)
    source = tmp_path / "llama"
    tiny_llama(vocab_size=512).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, source / name)
    converted = tmp_path / "converted"
    main(["convert", str(source), "--out", str(converted), "--kv-lora-rank", "16", "--rope-split", "exact", "--calibration-blocks",
          "8", "--block-size", "32", "--reconstruction-steps", "0"])  # fmt: skip
    quickstart = tmp_path / "quickstart"
    main(["quickstart", "--out", str(quickstart), "--steps", "1", "--batch-size", "2", "--block-size", "32"])
    return {"saved": saved, "converted": converted, "quickstart": quickstart}


def test_our_folders_load_their_tokenizer_without_remote_code_and_the_base_model_with_it(tmp_path):
    """In a fresh process where egmla cannot be imported: AutoTokenizer without `trust_remote_code` (the folder
    holds a Llama tokenizer), AutoModel and AutoModelForCausalLM with it (the folder's own code)."""
    folders = write_folders(tmp_path)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["egmla"] = None  # any `import egmla` now fails, as on a machine without the package
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
        for folder in {[str(folder) for folder in folders.values()]!r}:
            tokenizer = AutoTokenizer.from_pretrained(folder)
            assert tokenizer("Once upon a time").input_ids, folder
            base = AutoModel.from_pretrained(folder, trust_remote_code=True)
            assert type(base).__name__ == "EGMLAModel", type(base)
            causal = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
            assert type(causal).__name__ == "EGMLAForCausalLM", type(causal)
        print("loaded", len({list(folders)!r}))
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded 3" in result.stdout
