"""offload_gate_tables: the gate tables stay in CPU memory, rows are gathered per forward, training updates them."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from egmla import LORA_TARGET_MODULES, EGMLAForCausalLM, gate_table_names
from egmla.measure import parameter_bytes_by_device
from egmla.modeling_egmla import EGMLAGateTable
from tests.utils import tiny_model


def offloaded_copy(model: EGMLAForCausalLM) -> EGMLAForCausalLM:
    """The same weights with the gate tables offloaded."""
    config = model.config.__class__.from_dict({**model.config.to_dict(), "offload_gate_tables": True})
    offloaded = EGMLAForCausalLM(config).eval()
    offloaded.load_state_dict(model.state_dict())
    return offloaded


def table_bytes(model: EGMLAForCausalLM) -> int:
    return sum(table.weight.numel() * table.weight.element_size() for table in model.model.gate_embeddings)


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_logits_and_one_optimizer_step_equal_the_resident_tables(gate_position):
    model = tiny_model(gate_position=gate_position, gate_layers_per_table=1)
    offloaded = offloaded_copy(model)
    assert all(table.offload for table in offloaded.model.gate_embeddings)
    input_ids = torch.randint(3, 40, (2, 24), generator=torch.Generator().manual_seed(0))  # tokens repeat
    assert torch.equal(offloaded(input_ids).logits, model(input_ids).logits)

    for m in (model, offloaded):
        m.train()
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
        m(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
    for (name, expected), (_, parameter) in zip(model.named_parameters(), offloaded.named_parameters(), strict=True):
        torch.testing.assert_close(parameter, expected, rtol=0, atol=1e-6, msg=name)
    # Only the rows of the tokens in flight moved (the last token's gate reaches only the unscored last position).
    before = tiny_model(gate_position=gate_position).model.gate_embeddings[0].weight
    changed = (offloaded.model.gate_embeddings[0].weight != before).any(dim=-1)
    assert torch.equal(changed.nonzero().flatten(), input_ids[:, :-1].unique())


def test_tables_stay_in_cpu_memory_when_the_model_moves():
    model = offloaded_copy(tiny_model())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tables = table_bytes(model)
    # "meta" stands in for an accelerator here: everything moves but the tables.
    model.to("meta")
    assert all(table.weight.device.type == "cpu" for table in model.model.gate_embeddings)
    assert model.model.layers[0].self_attn.kv_b_proj.weight.device.type == "meta"
    assert parameter_bytes_by_device(model) == {"meta": total - tables, "cpu": tables}
    model.to(torch.bfloat16)  # a change of dtype is kept
    assert model.model.gate_embeddings[0].weight.dtype == torch.bfloat16
    assert model.model.gate_embeddings[0].weight.device.type == "cpu"


@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_generate_gives_the_same_tokens(gate_position):
    model = tiny_model(gate_position=gate_position)
    prompts = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(1))
    settings = {"max_new_tokens": 6, "do_sample": False, "attention_mask": torch.ones_like(prompts)}
    assert torch.equal(offloaded_copy(model).generate(prompts, **settings), model.generate(prompts, **settings))


def test_save_load_and_load_time_option(tmp_path):
    model = tiny_model()
    input_ids = torch.randint(3, 40, (1, 12), generator=torch.Generator().manual_seed(2))
    model.save_pretrained(tmp_path / "resident")
    loaded = EGMLAForCausalLM.from_pretrained(tmp_path / "resident", offload_gate_tables=True, device_map="cpu")
    assert loaded.config.offload_gate_tables
    assert all(isinstance(t, EGMLAGateTable) and t.offload for t in loaded.model.gate_embeddings)
    assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)

    loaded.save_pretrained(tmp_path / "offloaded")  # the option is saved with the config
    again = EGMLAForCausalLM.from_pretrained(tmp_path / "offloaded")
    assert again.config.offload_gate_tables and again.model.gate_embeddings[0].offload
    assert torch.equal(again(input_ids).logits, model(input_ids).logits)


def test_from_pretrained_puts_tables_placed_elsewhere_back_in_cpu_memory(tmp_path, monkeypatch):
    offloaded_copy(tiny_model()).save_pretrained(tmp_path)
    placed = []
    place = EGMLAGateTable.place_in_cpu_memory
    monkeypatch.setattr(EGMLAGateTable, "place_in_cpu_memory", lambda table: placed.append(table) or place(table))
    model = EGMLAForCausalLM.from_pretrained(tmp_path)
    assert placed == list(model.model.gate_embeddings)


def test_the_memory_report_counts_the_tables_in_cpu_memory():
    """benchmarks/model/offload_memory.py on the paper's model: the tables (12 x 50257 x 256 bf16) leave the
    accelerator."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "model" / "offload_memory.py"
    output = subprocess.run([sys.executable, str(script), "--device", "meta"], capture_output=True, text=True)
    assert output.returncode == 0, output.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in output.stdout.splitlines() if "| " in line}
    tables = 12 * 50257 * 256 * 2 / 2**20
    assert rows["offloaded"][1].strip() == f"{tables:,.1f} MiB"
    resident, offloaded = (float(rows[kind][0].split()[0].replace(",", "")) for kind in ("resident", "offloaded"))
    assert resident - offloaded == pytest.approx(tables, abs=0.2)


def test_peft_lora_trains_offloaded_tables_as_modules_to_save():
    model = tiny_model()
    offloaded = offloaded_copy(model)
    input_ids = torch.randint(3, 40, (2, 16), generator=torch.Generator().manual_seed(3))
    for m in (model, offloaded):
        config = LoraConfig(r=4, target_modules=LORA_TARGET_MODULES, modules_to_save=gate_table_names(m.config))
        torch.manual_seed(0)  # the same LoRA initialisation for both
        peft_model = get_peft_model(m, config).train()
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
        peft_model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
    tables = [t for t in offloaded.modules() if isinstance(t, EGMLAGateTable)]
    assert tables and all(t.offload and t.weight.device.type == "cpu" for t in tables)
    for (name, expected), (_, parameter) in zip(model.named_parameters(), offloaded.named_parameters(), strict=True):
        torch.testing.assert_close(parameter, expected, rtol=0, atol=1e-6, msg=name)


def test_the_table_follows_cpu_side_operations_and_refuses_accelerate_offload():
    table = offloaded_copy(tiny_model()).model.gate_embeddings[0]
    table.share_memory()  # a CPU-side operation is applied as asked
    assert table.weight.is_shared()
    table.weight = torch.nn.Parameter(torch.empty_like(table.weight, device="meta"))  # what accelerate's offload leaves
    with pytest.raises(ValueError, match="leave them out of accelerate's offload"):
        table.place_in_cpu_memory()


def test_finetune_refuses_offloaded_tables_in_several_processes(monkeypatch):
    from accelerate import Accelerator

    from egmla import training as finetune_module

    class TwoProcesses(Accelerator):
        num_processes = 2

    monkeypatch.setattr(finetune_module, "Accelerator", TwoProcesses)
    student = offloaded_copy(tiny_model())
    blocks = torch.randint(3, 40, (4, 16))
    with pytest.raises(ValueError, match="one process only"):
        finetune_module.finetune(
            student, None, blocks, finetune_module.FinetuneSettings(steps=1, distill_weight=0.0, ce_weight=1.0)
        )
