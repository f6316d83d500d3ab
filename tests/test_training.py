"""Training paths: gradient checkpointing and PEFT LoRA (with the gate tables trained alongside)."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from egmla import LORA_TARGET_MODULES, EGMLACache, EGMLAForCausalLM, gate_table_names
from tests.utils import MODES, incremental_logits, tiny_model


def gradients(model, input_ids):
    model.zero_grad()
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def counting(func, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return func(*args, **kwargs)

    return wrapper


def test_gradient_checkpointing_gives_the_same_gradients():
    for mode in ("gate-kv", "gate-latent"):
        model = tiny_model(**MODES[mode], q_lora_rank=24).train()
        input_ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        loss, plain = gradients(model, input_ids)

        calls = []
        model.activation_checkpointing_enable()
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = counting(layer._gradient_checkpointing_func, calls)
        checkpointed_loss, checkpointed = gradients(model, input_ids)

        assert len(calls) == model.config.num_hidden_layers  # every layer went through the checkpoint
        assert torch.equal(loss, checkpointed_loss)
        assert plain.keys() == checkpointed.keys()
        assert any("gate_embeddings" in name for name in plain)  # the gate tables do get gradients
        for name, grad in plain.items():
            assert torch.allclose(grad, checkpointed[name], atol=1e-6), name


def test_lora_train_save_load_merge(tmp_path):
    model = tiny_model(gate_position="kv")
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=LORA_TARGET_MODULES,
        modules_to_save=gate_table_names(model.config),
    )
    peft_model = get_peft_model(model, config)
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_A" in name for name in trainable)
    assert any("gate_embeddings" in name and "modules_to_save" in name for name in trainable)
    assert not any("embed_tokens" in name for name in trainable)

    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    input_ids = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = peft_model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]

    peft_model.eval()
    with torch.no_grad():
        trained_logits = peft_model(input_ids=input_ids).logits
        # Cached decoding under the adapter matches the uncached forward.
        cached = incremental_logits(peft_model, input_ids, prefill=20, cache=EGMLACache(model.config))
        torch.testing.assert_close(cached, trained_logits, rtol=0, atol=1e-5)

    peft_model.save_pretrained(tmp_path / "adapter")
    base = tiny_model(gate_position="kv")  # same seed: the same base weights
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=input_ids).logits, trained_logits, atol=1e-6)
        merged = loaded.merge_and_unload()
        assert isinstance(merged, EGMLAForCausalLM)
        assert torch.allclose(merged(input_ids).logits, trained_logits, atol=1e-5)


def test_lora_on_kv_b_proj_is_used_by_the_absorbed_decode():
    """With gate_position="latent" decoding folds kv_b_proj into the query: an unmerged adapter must count."""
    model = tiny_model(gate_position="latent")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["kv_b_proj"], init_lora_weights=False)).eval()
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = peft_model(input_ids=input_ids).logits
        cached = incremental_logits(peft_model, input_ids, prefill=6, cache=EGMLACache(model.config))
    torch.testing.assert_close(cached, reference, rtol=0, atol=1e-5)


def test_trains_with_the_transformers_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_model(gate_position="kv").train()
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 128, (32,), generator=generator) for _ in range(16)]
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=12,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 12 and losses[-1] < losses[0]
    # The gate tables are ordinary parameters: the Trainer's optimizer updated them.
    assert not torch.equal(
        trainer.model.model.gate_embeddings[0].weight, tiny_model(gate_position="kv").model.gate_embeddings[0].weight
    )


def test_checkpointed_training_ignores_a_filled_cache():
    """Checkpointed layers drop the cache; the gate's token ids must not be appended to it either."""
    model = tiny_model(gate_position="kv").train()
    model.activation_checkpointing_enable()
    input_ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    cache = EGMLACache(model.config)
    with torch.no_grad():
        model.eval()(input_ids[:, :4], cache=cache)
    model.train()
    out = model(input_ids, labels=input_ids, cache=cache)
    out.loss.backward()
    assert cache.get_seq_length() == 4 and cache.token_ids.shape == (2, 4)  # left as it was
