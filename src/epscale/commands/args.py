"""argparse helpers the commands share."""

from __future__ import annotations

import re

from ..launch.slurm import bad_option

_UNITS = {"": None, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def allow_intermixed(p) -> None:
    """Let ``key=value`` overrides come after options (``CONFIG --nproc 2 train.steps=9``):
    plain argparse stops collecting a positional list at the first option."""
    plain = p.parse_known_args

    def parse_known(args=None, namespace=None):
        del p.parse_known_args  # the intermixed parser calls the plain one twice inside
        try:
            return p.parse_known_intermixed_args(args, namespace)
        finally:
            p.parse_known_args = parse_known

    assert plain  # the class method, found again once the instance attribute is deleted
    p.parse_known_args = parse_known


def parse_size(option: str, text: str) -> int:
    """Bytes in a size such as '80GiB', '141GB' or '80G' (K/M/G/T alone are binary, as in
    Slurm's --mem)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = _UNITS.get(m.group(2).lower(), 0) if m else 0
    if not m or not unit or float(m.group(1)) <= 0:
        raise bad_option(option, text, "give a positive size with a unit, e.g. 80GiB, 141GB "
                                       "or 96G")
    return int(float(m.group(1)) * unit)


def add_overlap_calibration(p, title: str) -> None:
    """``--overlap-from RUN_DIR --overlap-cluster CLUSTER`` (describe and simulate): the step
    model's hidden communication scaled by what a measured run hid (epscale.plan.overlap)."""
    cal = p.add_argument_group(title)
    cal.add_argument("--overlap-from", default=None, metavar="RUN_DIR",
                     help="a measured run (metrics.jsonl with comm_by_kind, config.yaml): its "
                          "hidden communication against the step model's at its layout scales "
                          "the model's")
    cal.add_argument("--overlap-cluster", default=None, metavar="CLUSTER",
                     help="the cluster that run ran on (preset or epscale calibrate's YAML)")
