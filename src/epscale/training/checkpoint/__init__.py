"""Sharded checkpoints (DCP) that reshard across layouts and resume bit for bit: where they
live and whether one is sound (``paths``), what they hold (``state``), saving and loading
(``store``), and one full state dict to and from a checkpoint (``convert``)."""

from .convert import export_full, import_full, resolve
from .paths import (FORMAT_VERSION, CheckpointError, checkpoints_root, corrupt_root,
                    latest_valid, list_checkpoints, prune, read_meta, set_aside, step_dir,
                    validate)
from .state import build_state, check_compatible
from .store import (CheckpointSaveError, PendingSave, background_stager, load, load_extra,
                    rng_state, save, save_async, set_rng_state, staging_options)

__all__ = ["CheckpointError", "CheckpointSaveError", "FORMAT_VERSION", "corrupt_root", "prune",
           "set_aside", "build_state", "check_compatible",
           "checkpoints_root", "export_full", "import_full", "latest_valid", "list_checkpoints",
           "load", "load_extra", "read_meta", "resolve", "rng_state", "save", "save_async",
           "PendingSave", "set_rng_state", "background_stager", "staging_options",
           "step_dir", "validate"]
