"""Named presets: field values laid over the option dataclasses' defaults, which are `egmla convert`'s. `egmla
retrofit` applies "retrofit" (and "retrofit with text" when text is given), the main job (no source) "main job" or
"main job with text" after it; a flag given on the command line wins over every preset. Keys are the flags'
destinations (`reconstruction_steps` is `ReconstructionSettings.steps`). The runs behind each value are in
docs/results.md#behind-the-defaults."""

PRESETS: dict[str, dict[str, object]] = {
    # MHA2MLA's cut of SmolLM2-135M, sized for 2 CPU cores. Data-free: short sampled blocks, a longer layer-wise fit,
    # and the whole model recovered at a lower rate (on sampled text both of the text's choices ended worse).
    "retrofit": {
        "kv_cut": 0.6875,
        "sampled_block_size": 128,
        "sampled_blocks": 128,
        "calibration_blocks": 64,
        "reconstruction_steps": 200,
        "reconstruction_batch_size": 4,
        "max_minutes": 4.5,
        "learning_rate": 1e-4,
        "sample_prompt": "Once upon a time",
    },
    # With text: a short layer-wise fit, then the attention alone recovered for longer (its steps are cheaper).
    "retrofit with text": {
        "reconstruction_steps": 100,
        "max_minutes": 7.0,
        "attention_only": True,
        "learning_rate": 2e-4,
    },
    # The main job keeps its minutes on a slower machine too: its recovery is cut to what the limit leaves.
    "main job": {"time_limit": 15.0},
    "main job with text": {"time_limit": 20.0},
}


def preset_values(names: list[str], given: set[str]) -> dict[str, object]:
    """The presets `names`, later ones winning, without the fields in `given` (the flags a user wrote)."""
    values = {}
    for name in names:
        values.update(PRESETS[name])
    return {field: value for field, value in values.items() if field not in given}


def retrofit_presets(source_given: bool, text_given: bool) -> list[str]:
    """The presets `egmla retrofit` applies, in order."""
    names = ["retrofit", *(["retrofit with text"] if text_given else [])]
    if not source_given:
        names.append("main job with text" if text_given else "main job")
    return names
