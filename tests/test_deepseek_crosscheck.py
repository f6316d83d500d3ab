"""Our MLA baseline (gate off) equals transformers' own DeepSeek-V3 MLA with the same weights."""

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from egmla import EGMLAForCausalLM
from tests.utils import TINY, tiny_config


def deepseek_pair(q_lora_rank, gate_position):
    # The shared tiny shape, without the gate (DeepSeek has none), with DeepSeek's norm epsilon.
    common = {**{k: v for k, v in TINY.items() if k != "gate_embedding_dim"}, "q_lora_rank": q_lora_rank,
              "rms_norm_eps": 1e-6}  # fmt: skip
    torch.manual_seed(0)
    reference = DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **common,
            first_k_dense_replace=2,  # dense layers only
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            num_mtp_layers=0,
            rope_interleave=False,
        )
    ).eval()
    ours = EGMLAForCausalLM(
        tiny_config(**common, gate_embedding_dim=0, rope_key_heads=1, kv_latent_norm=True, gate_position=gate_position)
    ).eval()
    # Random norm weights, so that a norm missing on either side would show.
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
    ours.load_state_dict(reference.state_dict(), strict=True)
    return reference, ours


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["full-rank-q", "q-lora"])
@pytest.mark.parametrize("gate_position", ["kv", "latent"])
def test_same_logits_and_greedy_tokens_as_deepseek_v3(q_lora_rank, gate_position):
    reference, ours = deepseek_pair(q_lora_rank, gate_position)
    input_ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reference(input_ids).logits, ours(input_ids).logits, rtol=0, atol=1e-5)
        options = {"input_ids": input_ids[:, :6], "max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
        assert torch.equal(reference.generate(**options), ours.generate(**options))
