"""The smaller faults of issue #30 (finding 8) found by trying epscale as a new user:
numbers a user types that were misread, crashed with a traceback, were accepted or took
minutes. Each is one clear message naming the option or key, exit status 2."""

from __future__ import annotations

import pytest

from epscale.cli import main as cli_main
from epscale.config import ConfigError, load_config
from epscale.plan.fit import _divisors


def test_a_float_with_an_exponent_and_no_dot_is_a_number():
    """YAML 1.1 reads '1e-5' as a string ('must be a number'); configs read YAML 1.2."""
    cfg = load_config(None, ["train.lr=1e-5", "train.min_lr=0", "train.weight_decay=1E-2"])
    assert cfg.train.lr == 1e-5 and cfg.train.weight_decay == 0.01
    assert load_config(None, ["train.steps=12"]).train.steps == 12  # ints stay ints
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(None, ["train.lr=1e-5x"])


@pytest.mark.parametrize("args, message", [
    (["--temperature", "nan"], "--temperature nan is invalid: must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature -1.0 is invalid"),
    (["--max-new-tokens", "-3"], "--max-new-tokens -3 is invalid: must be >= 1"),
    (["--top-p", "0"], "--top-p 0.0 is invalid: must be in (0, 1]"),
])
def test_generate_rejects_bad_numbers_before_loading(tmp_path, capsys, args, message):
    # a run directory that does not exist: the numbers are checked first
    assert cli_main(["generate", str(tmp_path / "none"), "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, message", [
    (["--ep", "0"], "--ep 0 is invalid: must be a positive integer"),
    (["--micro-batch", "0"], "--micro-batch 0 is invalid: must be a positive integer"),
    (["--fit", "-5GiB"], "--fit = '-5GiB' is invalid: give a positive size"),
    (["--fit", "80GiB", "--nodes", "0"], "--nodes 0 is invalid"),
])
def test_describe_names_the_bad_option(capsys, args, message):
    assert cli_main(["describe", "tiny", *args]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_the_fit_search_is_not_linear_in_the_world():
    """describe --fit --nodes 99999999999 enumerated every number up to the world's size
    to find its divisors (minutes); now O(sqrt(world))."""
    assert all(_divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 600))
    world = 99_999_999_999 * 8
    divisors = _divisors(world)
    assert divisors[0] == 1 and divisors[-1] == world and len(divisors) == len(set(divisors))
    assert all(world % d == 0 for d in divisors) and divisors == sorted(divisors)
