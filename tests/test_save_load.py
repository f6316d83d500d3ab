"""Save/load, Auto classes and Hub remote code (a fresh process where `egmla` cannot be imported)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from egmla import EGMLAConfig, EGMLAForCausalLM, EGMLAModel
from tests.utils import tiny_model


def test_auto_classes_resolve_to_egmla():
    config = AutoConfig.for_model(
        "egmla", vocab_size=64, hidden_size=32, num_attention_heads=4, bos_token_id=1, eos_token_id=2
    )
    assert isinstance(config, EGMLAConfig)
    assert isinstance(AutoModel.from_config(config), EGMLAModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), EGMLAForCausalLM)


def test_round_trip_equal_logits_and_tied_weights_saved_once(tmp_path):
    model = tiny_model(tie_word_embeddings=True, gate_position="latent")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)

    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert {"configuration_egmla.py", "modeling_egmla.py"} <= set(os.listdir(tmp_path))
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_egmla.EGMLAConfig"
    assert auto_map["AutoModelForCausalLM"] == "modeling_egmla.EGMLAForCausalLM"

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, EGMLAForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    # The rotary buffers are not saved: they must be rebuilt, not left as garbage from the meta device.
    assert torch.equal(loaded.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    input_ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, loaded(input_ids).logits)
        assert torch.equal(
            model.generate(input_ids, max_new_tokens=8, do_sample=False),
            loaded.generate(input_ids, max_new_tokens=8, do_sample=False),
        )


def test_base_model_checkpoint_loads_into_causal_lm(tmp_path):
    model = tiny_model()
    model.model.save_pretrained(tmp_path)
    loaded = EGMLAModel.from_pretrained(tmp_path).eval()
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model.model(input_ids).last_hidden_state, loaded(input_ids).last_hidden_state)


def test_trust_remote_code_in_a_fresh_process_without_egmla(tmp_path):
    model = tiny_model(gate_position="kv", rope_key_heads=2)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    # A second folder loaded in the same process (an assistant, say) registers its own copy of the classes.
    other_dir = tmp_path / "other"
    tiny_model(seed=1, gate_position="kv").save_pretrained(other_dir)
    input_ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.generate(input_ids, max_new_tokens=8, num_beams=3, do_sample=False)
    torch.save({"input_ids": input_ids, "expected": expected}, tmp_path / "io.pt")

    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.modules["egmla"] = None  # any `import egmla` now fails, as on a machine without the package
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        other = AutoModelForCausalLM.from_pretrained({str(other_dir)!r}, trust_remote_code=True).eval()
        data = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            got = model.generate(data["input_ids"], max_new_tokens=8, num_beams=3, do_sample=False)
            other.generate(data["input_ids"], max_new_tokens=4, do_sample=False)
        assert torch.equal(got, data["expected"]), (got, data["expected"])
        print("remote code OK", type(model).__module__)
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    # Run from the temporary folder so that the repository's `egmla` folder is not on sys.path either.
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote code OK transformers_modules" in result.stdout


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_device_map_with_a_layer_offloaded_to_disk(tmp_path, gate_position):
    """accelerate's hooks move weights in only when a module is called: the absorbed decode must respect that."""
    model = tiny_model(gate_position=gate_position)
    model.save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.gate_embeddings": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    assert offloaded.hf_device_map["model.layers.1"] == "disk"
    input_ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    options = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    with torch.no_grad():
        assert torch.equal(model.generate(input_ids, **options), offloaded.generate(input_ids, **options))


def test_import_egmla_is_light_and_the_auto_classes_load_the_model_when_used(tmp_path):
    """`import egmla` loads neither peft nor accelerate (nor transformers' modeling_utils, which imports accelerate);
    the Auto classes then load the model file when a folder is opened, and hold the real class afterwards."""
    tiny_model().save_pretrained(tmp_path)
    probe = (
        "import sys\n"
        "import egmla\n"
        "print(sorted({'peft', 'accelerate', 'transformers.modeling_utils', 'egmla.modeling_egmla'} & set(sys.modules)))\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        "print(type(model).__module__, type(model).__name__)\n"
        "print(AutoModelForCausalLM._model_mapping[egmla.EGMLAConfig] is egmla.EGMLAForCausalLM)\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "print('egmla_fused' in ALL_ATTENTION_FUNCTIONS.valid_keys())\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:4] == [
        "[]",
        "egmla.modeling_egmla EGMLAForCausalLM",
        "True",
        "True",
    ], done.stdout


def test_the_package_has_no_import_cycle():
    """Every relative import in egmla/, at any depth of a module (a function-level import too), points down: the
    conversion is one way (plan -> search -> convert), the kernels take what the model hands them, and nothing but
    the bench command imports the bench command."""
    import ast
    from pathlib import Path

    import egmla

    root = Path(egmla.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        parts = ("egmla", *path.relative_to(root).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(parts if parts[-1] != "__init__" else parts[:-1])
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                imported.add(".".join((*base, node.module) if node.module else base))
        graph[name] = imported - {name}

    def cycle_from(start, seen):
        for nxt in graph.get(start, ()):
            if nxt in seen:
                return [*seen, nxt]
            found = cycle_from(nxt, [*seen, nxt])
            if found:
                return found
        return None

    packages = {name for name in graph if (root.parent / name.replace(".", "/") / "__init__.py").exists()}
    for name in graph:  # a package's __init__ re-exporting its modules is not a cycle of theirs
        graph[name] -= packages
    cycles = [cycle for name in graph if (cycle := cycle_from(name, [name]))]
    assert not cycles, cycles[0]
    # The library never depends on the `egmla bench` command (it measures the library, not the other way).
    upward = {name: sorted(i for i in imported if i.startswith("egmla.bench")) for name, imported in graph.items()}
    assert not {name: i for name, i in upward.items() if i and not name.startswith("egmla.bench")}
