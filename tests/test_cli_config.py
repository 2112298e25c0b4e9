"""k3.cli_config: flags generated from dataclass fields, flat names, and saved configs in either layout."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from k3.cli_config import (add_arguments, check_positive, flags_of, from_dict, from_flat, given, option,
                           replace_flat, section, to_flat)


@dataclass
class Inner:
    """recall tasks"""

    fraction: float = 0.0
    """share of rows replaced"""
    pairs: int = 8
    """key-value pairs"""
    every: int = field(default=50, metadata=option(name="save_every"))
    """steps between saves"""


@dataclass
class Optim:
    """optimizer"""

    lr: float = 3e-3
    """peak learning rate, 100% at the top"""
    clip: float | None = None
    """gradient clip (None: off)"""
    temperature: float = 1.0
    """set from the outer config"""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass
class Top:
    out: str = field(default="runs/x", metadata=option(required=True, aliases=("--to",)))
    """run directory"""
    steps: int = 10
    """steps in all"""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """weights"""
    mode: str = field(default="a", metadata=option(choices=("a", "b")))
    """one of two"""
    data: list[str] = field(default_factory=list)
    """a file; repeatable"""
    replay: bool = True
    """replay the routing"""
    graph: bool | None = None
    """graphed step"""
    ep: bool = field(default=False, metadata=option(negative="single", negative_help="one process"))
    """expert parallel"""
    schedule: list[list[int]] | None = field(default=None, metadata=option(
        parse=lambda text: [[int(n) for n in part.split(":")] for part in text.split(",")], metavar="L:S,..."))
    """curriculum"""
    overrides: dict = field(default_factory=dict, metadata=option(cli=False))
    optim: Optim = section(Optim, derived=("temperature",), default=lambda: Optim(lr=0.25))
    recall: Inner = section(Inner, prefix="recall")


def parser_for(cls=Top) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_arguments(parser, cls)
    return parser


def parse(*argv: str) -> Top:
    return from_flat(Top, given(Top, parser_for().parse_args(list(argv))))


def test_flags_are_flat_names_with_prefixes_and_overrides() -> None:
    assert flags_of(Top) == {"--out", "--to", "--steps", "--dtype", "--mode", "--data", "--no-replay",
                             "--graph", "--no-graph", "--ep", "--single", "--schedule", "--lr", "--clip",
                             "--recall-fraction", "--recall-pairs", "--save-every"}


def test_flags_left_out_keep_the_dataclass_defaults() -> None:
    assert parse("--out", "r") == Top(out="r")
    assert parse("--out", "r").optim.lr == 0.25  # a section's default, not its class's


def test_every_kind_of_flag_parses_into_its_field() -> None:
    config = parse("--to", "r", "--steps", "3", "--dtype", "bf16", "--mode", "b", "--data", "a.txt", "--data", "b",
                   "--no-replay", "--no-graph", "--ep", "--schedule", "8:0,16:5", "--lr", "0.5", "--clip", "2",
                   "--recall-fraction", "0.25", "--recall-pairs", "4", "--save-every", "7")
    assert config == Top(out="r", steps=3, dtype="bf16", mode="b", data=["a.txt", "b"], replay=False, graph=False,
                         ep=True, schedule=[[8, 0], [16, 5]], optim=Optim(lr=0.5, clip=2.0),
                         recall=Inner(fraction=0.25, pairs=4, every=7))
    assert parse("--out", "r", "--graph", "--single").replay is True
    assert parse("--out", "r", "--graph").graph is True
    assert parse("--out", "r", "--single").ep is False


@pytest.mark.parametrize("argv", [["--out", "r", "--dtype", "fp16"], ["--out", "r", "--mode", "c"],
                                  ["--out", "r", "--steps", "x"], ["--out", "r", "--ep", "--single"], ["--steps", "1"]])
def test_bad_flags_are_refused_by_argparse(argv: list[str]) -> None:
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser_for().parse_args(argv)


def test_help_is_the_field_docstring_with_its_default() -> None:
    text = " ".join(parser_for().format_help().split())
    assert "peak learning rate, 100% at the top (default 0.25)" in text
    assert "share of rows replaced (default 0.0)" in text
    assert "gradient clip (None: off) " in text  # no default shown for None
    assert "optimizer:" in text and "recall tasks:" in text  # a section is a help group titled by its docstring
    assert "--temperature" not in text and "--overrides" not in text


def test_a_section_validates_on_its_own() -> None:
    with pytest.raises(ValueError, match="lr must be positive"):
        parse("--out", "r", "--lr", "-1")


def test_a_type_without_a_flag_is_an_error_naming_the_field() -> None:
    @dataclass
    class Bad:
        table: dict = field(default_factory=dict)

    with pytest.raises(TypeError, match="Bad.table"):
        add_arguments(argparse.ArgumentParser(), Bad)


def test_two_fields_of_one_flat_name_are_an_error() -> None:
    @dataclass
    class Clash:
        recall_pairs: int = 1
        recall: Inner = section(Inner, prefix="recall")

    with pytest.raises(ValueError, match="recall_pairs"):
        flags_of(Clash)


def test_from_flat_refuses_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="no field 'lrr'"):
        from_flat(Top, lrr=1)
    with pytest.raises(ValueError, match="no field 'temperature'"):  # derived: the enclosing config sets it
        from_flat(Top, temperature=1)


def test_replace_flat_changes_named_fields_and_keeps_the_rest() -> None:
    base = from_flat(Top, out="r", lr=0.1, recall_pairs=3)
    changed = replace_flat(base, steps=5, save_every=9)
    assert changed == Top(out="r", steps=5, optim=Optim(lr=0.1), recall=Inner(pairs=3, every=9))
    assert from_flat(Top, clip=1.0).optim == Optim(lr=0.25, clip=1.0)  # flat names start from the section default
    assert base.steps == 10 and base.recall.every == 50
    with pytest.raises(ValueError, match="lr must be positive"):
        replace_flat(base, lr=0)


def test_saved_configs_read_back_in_the_nested_and_the_old_flat_layout() -> None:
    import dataclasses

    config = from_flat(Top, out="r", lr=0.1, recall_fraction=0.5, save_every=3, data=["a"])
    assert from_dict(Top, dataclasses.asdict(config)) == config
    assert from_dict(Top, to_flat(config)) == config
    old = {"out": "r", "lr": 0.1, "recall_fraction": 0.5, "save_every": 3, "data": ["a"]}
    assert from_dict(Top, old) == config


def test_from_dict_refuses_unknown_keys_in_either_layout() -> None:
    with pytest.raises(ValueError, match="no field 'bogus'"):
        from_dict(Top, {"bogus": 1})
    with pytest.raises(ValueError, match="Top.optim has no field 'bogus'"):
        from_dict(Top, {"optim": {"bogus": 1}})


@dataclass
class Rollout:
    threads: int = 8


@dataclass
class Run:
    rollout: Rollout = section(Rollout, no_flag=("threads",))


def test_a_field_without_a_flag_is_not_read_from_an_attribute_of_its_name() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Run)
    parser.add_argument("--threads", type=int, default=0)  # the command's own flag of the same name
    args = parser.parse_args(["--threads", "2"])
    assert given(Run, args) == {} and from_flat(Run, threads=3).rollout.threads == 3


@pytest.mark.parametrize("value, message", [
    (0, r"heldout_every must be at least 1, got 0"),
    (-2, r"heldout_every must be at least 1, got -2"),
    (0.0, r"heldout_every must be positive \(above 0\), got 0.0"),
    (float("nan"), r"heldout_every must be positive \(above 0\), got nan"),
])
def test_check_positive_names_the_field_and_what_would_be_right(value, message):
    config = Inner(pairs=3)
    config.every = value
    check_positive(config, "pairs")
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_positive(config, "pairs", "every", prefix="heldout_")
