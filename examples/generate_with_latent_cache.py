"""Build an EG-MLA model, generate with its latent cache, and compare the cache with plain MLA's.

python examples/generate_with_latent_cache.py
"""

import torch
from transformers import AutoModelForCausalLM

import egmla  # noqa: F401  (registers EG-MLA with the Auto classes)
from egmla import EGMLACache, EGMLAConfig, cache_nbytes

torch.manual_seed(0)
for preset in ("paper-mla-base", "paper-egmla-kv64", "paper-egmla-kv16"):
    # The paper's 12-layer, width-768 models, shrunk to 2 layers and a small vocabulary to run in seconds.
    config = EGMLAConfig.from_preset(preset, num_hidden_layers=2, vocab_size=1000, bos_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = torch.randint(2, 1000, (4, 32))

    cache = EGMLACache(config)  # or let generate() build one
    model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=16, do_sample=False)
    tokens = prompt.shape[0] * cache.get_seq_length()
    print(
        f"{preset:18s} cache {cache_nbytes(cache) / tokens / config.num_hidden_layers:6.1f} bytes/token/layer "
        f"(latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim} values, fp32"
        f"{', + the token id' if config.caches_token_ids else ''})"
    )
