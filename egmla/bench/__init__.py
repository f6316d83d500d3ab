"""The paper's figure at a size this machine runs: `egmla bench kv | decode | train | figure`.

Each command writes its measurements as JSON under a results folder (default `benchmarks/results`), so the figure
can be redrawn without measuring again; `--quick` runs each at toy size in seconds (the tests use it).
"""
