"""--device and --dtype: a conversion in bfloat16 stays as near its float32 conversion as bfloat16 keeps the source
itself, its output is saved in bfloat16, and a device string other than the default ("auto") is honoured or refused
by name."""

import json

import pytest
import torch
from safetensors import safe_open

from egmla.cli import main
from egmla.conversion import ConversionOptions, convert_llama_to_egmla, load_llama
from egmla.conversion.pipeline import run_ppl
from egmla.options import Placement
from tests.utils import FAST, TOKENIZER, llama_folder, tiny_llama


def test_a_bfloat16_conversion_stays_near_the_float32_one():
    """Statistics and factors are computed in float32/float64 whatever the weights' dtype, so converting in bfloat16
    adds no more than a few times the rounding bfloat16 brings to the source itself."""
    source32 = tiny_llama()
    source16 = load_llama(source32, Placement(device="cpu", dtype="bfloat16"))
    assert source32.dtype == torch.float32  # the caller's model is copied, not cast
    calibration = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(0))
    options = ConversionOptions(kv_cut=0.5, rope_split="shared")
    student32 = convert_llama_to_egmla(source32, options, calibration)
    student16 = convert_llama_to_egmla(source16, options, calibration)
    assert {p.dtype for p in student16.parameters()} == {torch.bfloat16}
    input_ids = torch.randint(3, 96, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source_rounding = (source32(input_ids).logits - source16(input_ids).logits.float()).abs().max()
        conversion_rounding = (student32(input_ids).logits - student16(input_ids).logits.float()).abs().max()
    assert conversion_rounding <= 3 * source_rounding, (conversion_rounding, source_rounding)


def test_convert_and_ppl_run_on_a_named_device_in_bfloat16(tmp_path):
    source = llama_folder(tmp_path / "src")
    out = tmp_path / "out"
    main(["convert", str(source), "--out", str(out), *FAST, "--device", "cpu", "--dtype", "bfloat16"])
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["placement"] == {"device": "cpu", "dtype": "bfloat16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    text = tmp_path / "text.txt"
    text.write_text((TOKENIZER / "tokenizer_config.json").read_text() * 3)
    ppl16 = run_ppl(str(out), text, block_size=32, max_blocks=4, placement=Placement(device="cpu", dtype="bfloat16"))
    ppl32 = run_ppl(str(out), text, block_size=32, max_blocks=4, placement=Placement(device="cpu"))
    assert ppl16 == pytest.approx(ppl32, rel=0.02)


def test_bad_devices_and_dtypes_are_refused_by_name():
    with pytest.raises(ValueError, match="device must be 'auto' or a torch device"):
        Placement(device="gpu0")
    with pytest.raises(ValueError, match=r"dtype \(--[a-z-]+\) must be one of"):
        Placement(dtype="int8")
    if not torch.accelerator.is_available():
        with pytest.raises(ValueError, match="device 'cuda' is not available on this machine"):
            load_llama(tiny_llama(), Placement(device="cuda"))
    assert Placement().torch_device().type == (torch.accelerator.current_accelerator() or torch.device("cpu")).type
