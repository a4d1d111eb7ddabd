"""The error every data problem raises, and the constants the data modules share."""

from __future__ import annotations

from ...config import ConfigError

BYTE_VOCAB = 256  # ids of the byte-level text sources (no end-of-document id)


class DataError(ConfigError):
    """A data source, input file, tokenizer or prepared dataset that cannot be used; the
    message names the path, what is wrong and what to do."""
