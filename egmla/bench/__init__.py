"""The paper's figure at a size this machine runs: `egmla bench kv | decode | train | figure`.

Each command writes its measurements as JSON under a results folder (default `benchmarks/results`), so the figure
can be redrawn without measuring again; `--quick` runs each at toy size in seconds (the tests use it).

What belongs here: the panels of the paper's figure and the models they compare (`models.py`), one module per panel
(`kv.py`, `decode.py`, `train.py`) and the figure (`figure.py`). One-question measurement scripts live in the
repository's `benchmarks/` folder instead.
"""
