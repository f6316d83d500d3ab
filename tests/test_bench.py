"""`egmla bench` in quick mode: every panel measures, writes its JSON, and the figure draws from them."""

import json

from egmla.bench.decode import VARIANTS
from egmla.cli import main


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
    assert {row["batch"] for row in decode["grid"]} == {1, 2}
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
