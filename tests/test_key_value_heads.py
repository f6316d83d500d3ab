"""`num_key_value_heads`: keys and values rebuilt once per key head, each serving a group of query heads (GQA).

A model with fewer key heads is the model whose up-projection repeats each key head's rows for every query head of
its group: every path (prefill by SDPA and eager, the absorbed and blocked decodes, the compiled and Triton kernels)
must give that twin's logits, with fewer parameters.
"""

import pytest
import torch

from egmla import EGMLACache, EGMLAForCausalLM
from tests.utils import MODES, incremental_logits, tiny_model

KEY_HEADS = 2  # of TINY's 4 query heads
IMPLEMENTATIONS = ["sdpa", "eager", "egmla_fused_compiled", "egmla_fused_triton"]


def per_query_head_twin(model: EGMLAForCausalLM) -> EGMLAForCausalLM:
    """The same model with one key head per query head: each key head's rows of W^{UKV} (and of W^{UE} for the
    gate on K/V) repeated for every query head of its group."""
    config = model.config.to_dict() | {"num_key_value_heads": model.config.num_attention_heads}
    twin = EGMLAForCausalLM(type(model.config)(**config)).eval()
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith("kv_b_proj.weight") or (name.endswith("gate_embedding_proj.weight") and
                                                 model.config.gate_position == "kv"):  # fmt: skip
            heads = tensor.view(model.config.num_key_value_heads, -1, tensor.shape[-1])
            state[name] = heads.repeat_interleave(group, dim=0).flatten(0, 1)
    twin.load_state_dict(state)
    return twin


# Two rope keys (one per key head) where the rope key is decoupled; "exact" rope has none.
@pytest.mark.parametrize(("mode", "rope_key_heads"), [(mode, 1 if "exact" in mode else 2) for mode in MODES])
def test_fewer_key_heads_equal_their_per_query_head_twin_in_every_path(mode, rope_key_heads):
    model = tiny_model(seed=3, num_key_value_heads=KEY_HEADS, rope_key_heads=rope_key_heads, **MODES[mode])
    twin = per_query_head_twin(model)
    assert model.num_parameters() < twin.num_parameters()
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(4))  # 6 decode steps
    with torch.no_grad():
        expected = twin(input_ids, use_cache=False).logits
        for implementation in IMPLEMENTATIONS:
            model.set_attn_implementation(implementation)
            uncached = model(input_ids, use_cache=False).logits
            torch.testing.assert_close(uncached, expected, rtol=0, atol=1e-5, msg=implementation)
            cached = incremental_logits(model, input_ids, prefill=6, cache=EGMLACache(model.config))
            torch.testing.assert_close(cached, expected, rtol=0, atol=1e-4, msg=implementation)


def test_generate_with_fewer_key_heads_gives_the_twins_tokens():
    model = tiny_model(seed=5, num_key_value_heads=KEY_HEADS, **MODES["exact-gate-kv"])
    twin = per_query_head_twin(model)
    prompts = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(6))
    settings = {"max_new_tokens": 10, "do_sample": False}
    assert torch.equal(model.generate(prompts, **settings), twin.generate(prompts, **settings))
