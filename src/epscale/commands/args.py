"""argparse helpers the commands share."""

from __future__ import annotations


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
