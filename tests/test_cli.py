"""The CLI is built from the option dataclasses' fields, one flag each; `retrofit` lays its presets over them."""

import dataclasses

import pytest

from egmla.cli import build_parser, conversion_options, reconstruction_settings
from egmla.conversion import ConversionOptions
from egmla.conversion.fitting_text import TextSettings
from egmla.conversion.pipeline import ConversionJob, FinetuneJob
from egmla.conversion.reconstruction import ReconstructionSettings
from egmla.data import EXCERPT
from egmla.quickstart import QuickstartSettings
from egmla.training import FinetuneSettings
from tests.utils import STORIES260K

# A real source and text: a job checks both when it is built.
SRC, TEXT = str(STORIES260K), str(EXCERPT)


def options_of(*flags: str) -> ConversionOptions:
    return conversion_options(vars(build_parser().parse_args(["convert", "SRC", "--out", "OUT", *flags])))


@pytest.mark.parametrize(
    ("command", "cls", "prefix"),
    [
        ("convert", ConversionOptions, ""),
        ("convert", TextSettings, ""),
        ("convert", FinetuneSettings, ""),
        ("convert", ReconstructionSettings, "reconstruction_"),
        ("convert", ConversionJob, ""),
        ("retrofit", ConversionOptions, ""),
        ("finetune", FinetuneSettings, ""),
        ("finetune", FinetuneJob, ""),
        ("quickstart", QuickstartSettings, ""),
    ],
)
def test_every_option_field_is_a_flag_with_its_help_and_choices(command, cls, prefix):
    """Declared once: each `option` field of the command's dataclasses is a flag named after it, with its help
    text and choices, and no other spelling."""
    parser = build_parser()
    subparser = parser._subparsers._group_actions[0].choices[command]
    actions = {action.dest: action for action in subparser._actions}
    declared = [field for field in dataclasses.fields(cls) if "help" in field.metadata]
    assert declared
    for field in declared:
        if prefix + field.name not in actions:  # a job field another command declares (`stream` is `convert`'s)
            assert cls is ConversionJob and field.name in ("stream", "sample_prompt")
            continue
        action = actions[prefix + field.name]
        flag = f"--{(prefix + field.name).replace('_', '-')}"
        assert action.option_strings in ([flag], [flag, flag.replace("--", "--no-", 1)])
        assert action.help == field.metadata["help"].replace("%", "%%")
        assert action.choices == field.metadata["choices"]


def test_parsed_flags_become_the_dataclasses():
    args = build_parser().parse_args(
        ["convert", "SRC", "--out", "OUT", "--kv-cut", "0.5", "--gate-embedding-dim", "8", "--learning-rate", "5e-4",
         "--reconstruction-steps", "7", "--reconstruction-gate-init", "identity", "--calibration-blocks", "3",
         "--seed", "4"]
    )  # fmt: skip
    assert conversion_options(vars(args)).gate_embedding_dim == 8 and conversion_options(vars(args)).seed == 4
    settings = reconstruction_settings(vars(args))
    assert (settings.steps, settings.gate_init, settings.seed) == (7, "identity", 4)
    assert args.learning_rate == 5e-4 and args.calibration_blocks == 3


@pytest.mark.parametrize(
    ("flags", "rope_split"),
    [
        ((), "auto"),
        (("--rope-split", "per_head"), "per_head"),
        (("--rope-split", "exact"), "exact"),
        (("--rope-pairs", "3"), "shared"),  # a given width leaves nothing to choose
    ],
)
def test_rope_split(flags, rope_split):
    assert options_of("--kv-cut", "0.5", *flags).rope_split == rope_split


@pytest.mark.parametrize(
    "flags",
    [("--rope-mode", "exact"), ("--rope-keys", "per_head"), ("--gate-dim", "8"), ("--calib-blocks", "3"),
     ("--lr", "1e-4"), ("--grad-accum", "2"), ("--calib-text", TEXT)],
)  # fmt: skip
def test_no_other_spelling_of_a_flag(flags, capsys):
    """Nothing is released: one spelling per option (argparse's prefix matching aside)."""
    with pytest.raises(SystemExit):
        options_of("--kv-cut", "0.5", *flags)
    assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the output folder is --out, not a second positional
        build_parser().parse_args(["convert", "SRC", "OUT", "--kv-cut", "0.5"])


@pytest.mark.parametrize("command", ["convert", "retrofit", "finetune", "quickstart"])
def test_each_command_lists_at_most_60_options(command):
    subparser = build_parser()._subparsers._group_actions[0].choices[command]
    assert len([action for action in subparser._actions if action.dest != "help"]) <= 60


def test_a_choice_outside_a_fields_choices_is_refused_by_name():
    with pytest.raises(ValueError, match=r"pair_selection \(--[a-z-]+\) must be one of"):
        ConversionOptions(kv_cut=0.5, pair_selection="largest")
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        options_of("--kv-cut", "0.5", "--rope-split", "partial")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"max_minutes": 4.5, "attention_only": False, "learning_rate": 1e-4, "reconstruction_steps": 200,
              "reconstruction_batch_size": 4, "time_limit": None}),
        (["--train-text", TEXT], {"max_minutes": 7.0, "attention_only": True, "learning_rate": 2e-4,
                                     "reconstruction_steps": 100, "reconstruction_batch_size": 4, "time_limit": None}),
        (["--max-minutes", "2", "--learning-rate", "3e-4", "--time-limit", "30"],
         {"max_minutes": 2.0, "learning_rate": 3e-4, "time_limit": 30.0}),
    ],
    ids=["data-free", "text", "given"],
)  # fmt: skip
def test_retrofit_settings_follow_its_text_unless_given(monkeypatch, flags, expected):
    """`egmla retrofit` with text: a 100-step layer-wise fit and 7 minutes recovering the attention alone at 2e-4;
    data-free: 200 steps and 4.5 minutes recovering the whole model at 1e-4; a source given has no time limit (the
    main job's is tested below); a flag given wins. The fitting runs under bf16 autocast where it pays (`auto`)."""
    import egmla.cli as cli

    jobs = []
    monkeypatch.setattr(cli, "run_conversion", jobs.append)
    cli.main(["retrofit", SRC, "--out", "OUT", *flags])
    finetune, reconstruction = jobs[0].finetune, jobs[0].reconstruction
    settings = {
        **vars(finetune),
        "reconstruction_steps": reconstruction.steps,
        "reconstruction_batch_size": reconstruction.batch_size,
        "time_limit": jobs[0].time_limit,
    }
    assert {name: settings[name] for name in expected} == expected and finetune.steps is None
    assert finetune.mixed_precision == "auto" and reconstruction.mixed_precision == "auto"
    assert jobs[0].text.sample_temperatures == (0.7, 0.85, 1.0)  # the source's samples cycle through them
    # data-free, it samples short blocks; text given to it is cut like `convert`'s
    assert jobs[0].text.sampled_block_size == 128 and jobs[0].text.block_size == TextSettings.block_size


def test_the_main_job_keeps_its_minutes(monkeypatch):
    """With no source (the main job), the recovery is shortened to fit 15 minutes (20 with text); `convert` takes a
    limit only when given one."""
    import egmla.cli as cli

    jobs = []
    monkeypatch.setattr(cli, "run_conversion", jobs.append)
    monkeypatch.setattr(cli, "smollm2_gguf", lambda: SRC)
    cli.main(["retrofit", "--out", "OUT"])
    cli.main(["retrofit", "--out", "OUT", "--train-text", TEXT])
    cli.main(["retrofit", "--out", "OUT", "--time-limit", "30"])
    cli.main(["convert", SRC, "--out", "OUT", "--kv-cut", "0.5"])
    cli.main(["convert", SRC, "--out", "OUT", "--kv-cut", "0.5", "--time-limit", "12", "--train-text", TEXT])
    assert [job.time_limit for job in jobs] == [15.0, 20.0, 30.0, None, 12.0]


def test_a_flag_whose_default_is_true_can_be_turned_off(monkeypatch):
    import egmla.cli as cli

    jobs = []
    monkeypatch.setattr(cli, "run_conversion", jobs.append)
    cli.main(["retrofit", SRC, "--out", "OUT", "--train-text", TEXT, "--no-attention-only"])
    assert not jobs[0].finetune.attention_only
    cli.main(["retrofit", SRC, "--out", "OUT", "--train-text", TEXT, "--lora"])  # LoRA chooses what trains
    assert jobs[1].finetune.lora and not jobs[1].finetune.attention_only


def test_retrofit_refuses_a_recovery_of_no_minutes(monkeypatch):
    """`--max-minutes 0` is an error naming the field, not the default's minutes in disguise."""
    import egmla.cli as cli

    monkeypatch.setattr(cli, "run_conversion", lambda job: None)
    with pytest.raises(SystemExit, match=r"max_minutes \(--max-minutes\) must be > 0"):
        cli.main(["retrofit", SRC, "--out", "OUT", "--max-minutes", "0"])
    for minutes in ("-1", "nan"):
        with pytest.raises(SystemExit, match=r"time_limit \(--time-limit\) must be (a number and be )?> 0"):
            cli.main(["retrofit", SRC, "--out", "OUT", "--time-limit", minutes])
