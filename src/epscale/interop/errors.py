"""The one error of Hugging Face interop (torch-free, so the family checks of
:mod:`epscale.interop.hf_families` can be read by ``describe`` without torch)."""

from __future__ import annotations

from ..config import ConfigError


class HFError(ConfigError):
    """A Hugging Face directory, config or tensor that cannot be used, or a model that
    cannot be written; the message names the file (and tensor) or the setting."""
