"""`egmla bench` in quick mode: every panel measures, writes its JSON, and the figure draws from them."""

import json

import pytest
import torch
from transformers import DynamicCache

from egmla.bench.decode import VARIANTS
from egmla.cli import main
from tests.utils import MODES, STORIES260K, TOKENIZER_SIZE, tiny_model, tiny_source, with_tokenizer


def test_bench_quick_mode_measures_every_panel_and_draws_the_figure(tmp_path, capsys):
    results = tmp_path / "results"
    for panel in ("kv", "decode", "train", "figure"):
        main(["bench", panel, "--quick", "--results", str(results)])

    kv = json.loads((results / "kv.json").read_text())
    # Panel (c): the bytes the real caches hold match the arithmetic (one layer in quick mode).
    for name, row in kv["rows"].items():
        assert row["elements_per_token"] == row["expected"], name
    assert [kv["rows"][name]["expected"] for name in ("mha", "mla-base", "egmla-kv64", "egmla-kv16")] == [
        1536,
        320,
        128,
        80,
    ]
    assert kv["rows"]["egmla-kv64"]["token_id_bytes_per_token"] == 8  # the gate's token ids, counted apart

    decode = json.loads((results / "decode.json").read_text())
    assert [(row["batch"], row["context"]) for row in decode["grid"]] == [(2, 32)]  # quick mode's one cell
    for row in decode["grid"]:
        assert set(row["ms_per_token"]) == {column for column, _, _ in VARIANTS}  # default and compiled static
        assert all(value > 0 for value in row["ms_per_token"].values())
    assert decode["cache_bytes_per_token"]["egmla-kv64-static"] == decode["cache_bytes_per_token"]["egmla-kv64"]
    budget = decode["budget"]["models"]
    # A smaller cache fits more sequences into the same budget.
    assert budget["egmla-kv64"]["sequences"] > budget["mla-base"]["sequences"] > budget["mha"]["sequences"]

    train = json.loads((results / "train.json").read_text())
    assert list(train["runs"]) == ["mla-r32", "egmla-r8-g0", "egmla-r8-g16"]
    for run in train["runs"].values():
        assert run["tokens"] == 4 * 4 * 64 and len(run["curve"]) == 2
        assert 0 <= run["held_out_accuracy"] <= 1
    assert train["runs"]["egmla-r8-g16"]["gate_table_parameters"] == 2 * 512 * 16

    png = results / "figure.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (results / "figure.md").read_text().count("|") > 20

    # A second train run reuses the cached results instead of training again.
    capsys.readouterr()
    main(["bench", "train", "--quick", "--results", str(results)])
    assert "cached in" in capsys.readouterr().out


def test_bench_converted_times_a_conversion_against_its_source(tmp_path, capsys):
    """`egmla bench converted SRC OUT`: both models continue the same text in every cell, on their default path and
    compiled over a static cache holding the same contents; the budget fits more sequences of the smaller cache."""
    from egmla.conversion import ConversionOptions, convert_llama_to_egmla
    from egmla.conversion.source import load_llama

    source = load_llama(STORIES260K)
    out = tmp_path / "stories-absorbed"
    convert_llama_to_egmla(
        source, ConversionOptions(kv_cut=0.5, rope_split="shared", rope_pairs=2, factorization="weight")
    ).save_pretrained(out)
    results = tmp_path / "results"
    main(["bench", "converted", str(STORIES260K), str(out), "--cells", "2x48", "2x40", "--repetitions", "1",
          "--results", str(results)])  # fmt: skip
    result = json.loads((results / "converted.json").read_text())
    assert [(row["batch"], row["context"]) for row in result["grid"]] == [(2, 40), (2, 48)]
    for row in result["grid"]:
        assert set(row["ms_per_step"]) == {
            "source",
            "source, compiled static",
            out.name,
            f"{out.name}, compiled static",
        }
        assert all(ms > 0 for ms in row["ms_per_step"].values())
    budget = result["budget"]["models"]
    assert result["budget"]["context"] == 40 and budget["source"]["sequences"] == 2
    assert budget[out.name]["cache_bytes_per_token"] == budget["source"]["cache_bytes_per_token"] / 2
    assert budget[out.name]["sequences"] == 4  # half the bytes per token: twice the sequences
    assert "ratio to the source's default path" in capsys.readouterr().out


def test_a_timed_step_leaves_windowed_caches_as_they_were():
    """`DecodeState.step` decodes a token and crops it back. With the past recorded (`prefilled`), that holds for
    windowed layers below, at and past their window, egmla's and transformers': every layer holds what it held, and
    the next step's logits are an uncached forward's. The cache is a prefill continued across the window, as
    `bench converted` continues its cells."""
    from egmla.bench.converted import prefilled
    from egmla.measure import DecodeState

    for model in (tiny_model(**MODES["gemma"]).eval(), tiny_source("gemma3", sliding_window=6).eval()):
        window = model.config.sliding_window
        rows = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
        for context in (window - 2, window - 1, 19):
            cache = prefilled(model, rows[:, :2])
            prefilled(model, rows[:, :context], cache)
            held = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
            position = torch.full((2, 1), context)
            state = DecodeState(model.forward, cache, rows[:, context : context + 1], position)
            with torch.no_grad():
                state.step()
                state.step()
                assert all(torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
                           for layer, (keys, values) in zip(cache.layers, held, strict=True))  # fmt: skip
                got = model(rows[:, context : context + 1], cache=cache, position_ids=position).logits
                expected = model(rows[:, : context + 1], cache=DynamicCache(config=model.config)).logits[:, -1:]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{type(model).__name__} {context}")


def test_timing_a_random_cache_holds_its_context_and_refuses_a_window_it_cannot_roll_back():
    """The report's decode cell fills caches with random contents (`decode_state`): a windowed layer's steps are rolled
    back like the rest; a transformers static cache drops positions past its windows, so timing it is refused."""
    from egmla.measure import decode_state

    for model in (tiny_model(**MODES["gemma"]).eval(), tiny_source("gemma3", sliding_window=6).eval()):
        filled = decode_state(model, "dynamic", 2, 20)
        held = [layer.keys.clone() for layer in filled.cache.layers]
        with torch.no_grad():
            filled.step()
            filled.step()
        assert filled.cache.get_seq_length() == 20
        assert all(torch.equal(layer.keys, keys) for layer, keys in zip(filled.cache.layers, held, strict=True))
    with pytest.raises(ValueError, match="drops positions past its windows"):
        decode_state(tiny_source("gemma3", sliding_window=6).eval(), "static", 2, 20)


def test_bench_converted_times_a_windowed_gemma3_conversion_on_its_default_path(tmp_path):
    """A Gemma 3 source and its conversion, both with windowed layers (contexts past the window): each cell continues
    the last one's cache, each timed step is cropped back, on the default path; the budget counts the windows."""
    from egmla.conversion import ConversionOptions, convert_llama_to_egmla

    teacher = tiny_source("gemma3", vocab_size=TOKENIZER_SIZE["gemma3"])
    teacher.save_pretrained(tmp_path / "gemma3")
    source = with_tokenizer(tmp_path / "gemma3")
    out = tmp_path / "converted"
    options = ConversionOptions(kv_cut=0.5, rope_split="shared", rope_pairs=4, factorization="weight")
    convert_llama_to_egmla(source, options).save_pretrained(out)
    results = tmp_path / "results"
    main(["bench", "converted", str(source), str(out), "--cells", "2x48", "2x40", "--repetitions", "1",
          "--results", str(results)])  # fmt: skip
    result = json.loads((results / "converted.json").read_text())
    assert [(row["batch"], row["context"]) for row in result["grid"]] == [(2, 40), (2, 48)]
    assert all(set(row["ms_per_step"]) == {"source", out.name} for row in result["grid"])
    budget = result["budget"]["models"]
    assert budget[out.name]["cache_bytes_per_token"] < budget["source"]["cache_bytes_per_token"]


def test_the_benchmarks_static_copy_continues_like_the_dynamic_cache():
    """The compiled column times the same step: a static cache copied from a prefilled dynamic one gives the same
    next-token logits (every gate and rope mode keeps its ids and positions through the copy)."""
    from egmla.bench.converted import prefilled, static_copy

    for mode, overrides in MODES.items():
        if "sliding_window" in overrides:  # a windowed layer keeps its window only: timed on its default path alone
            continue
        model = tiny_model(**overrides).eval()
        rows = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        dynamic = prefilled(model, rows[:, :-1])
        static = static_copy(model, dynamic)
        position = torch.full((2, 1), 11)
        with torch.no_grad():
            expected = model(rows[:, -1:], cache=dynamic, position_ids=position).logits
            got = model(rows[:, -1:], cache=static, position_ids=position).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=mode)
