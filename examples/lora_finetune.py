"""LoRA on every EG-MLA linear layer, with the gate tables trained in full alongside, then merged.

python examples/lora_finetune.py
"""

import torch
from peft import LoraConfig, get_peft_model

from egmla import LORA_TARGET_MODULES, EGMLAConfig, EGMLAForCausalLM, gate_table_names

torch.manual_seed(0)
config = EGMLAConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    gate_embedding_dim=32,
    bos_token_id=0,
    eos_token_id=1,
)
model = EGMLAForCausalLM(config)
lora = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGET_MODULES, modules_to_save=gate_table_names(config))
model = get_peft_model(model, lora)
model.print_trainable_parameters()

optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
data = torch.randint(2, 256, (8, 64))
for step in range(20):
    loss = model(input_ids=data, labels=data).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 5 == 0 or step == 19:
        print(f"step {step:2d} loss {loss.item():.3f}")

merged = model.merge_and_unload()  # a plain EGMLAForCausalLM again, ready for save_pretrained
print(type(merged).__name__)
