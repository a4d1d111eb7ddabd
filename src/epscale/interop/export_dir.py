"""The folder an export writes into: empty, absent, or one epscale exported into before.

An export records the files it writes in ``epscale_export.json`` (written first, so an
interrupted export is still recognised as epscale's). Writing again into such a folder
replaces exactly those files; anything else there stays, and is never listed as
exported. A folder holding files epscale did not write is refused (an HFError naming the
folder and what is in the way) unless ``overwrite``: then the model files in the way
(config, weights, index, tokenizer and generation files) are replaced and the rest is
left alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import HFError
from .hf_tokenizer import TOKENIZER_FILES

MANIFEST = "epscale_export.json"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
               "pytorch_model.bin", "pytorch_model.bin.index.json", *TOKENIZER_FILES)


def is_model_file(name: str) -> bool:
    """A file transformers reads as part of a model folder."""
    return name in MODEL_FILES or name.endswith(".safetensors") or \
        (name.startswith("pytorch_model") and name.endswith(".bin"))


def exported_files(out_dir: Path) -> list[str]:
    """The files an earlier export recorded in ``out_dir`` (empty when none did)."""
    f = Path(out_dir) / MANIFEST
    if not f.is_file():
        return []
    try:
        data = json.loads(f.read_text())
        files = data.get("files") if isinstance(data, dict) else None
    except (OSError, ValueError):
        files = None
    if not isinstance(files, list) or not all(isinstance(n, str) and "/" not in n
                                              and n not in ("", ".", "..") for n in files):
        raise HFError(f"'{f}' is not a readable record of an earlier export; remove it (and "
                      "the files it lists) or export into another folder")
    return files


def prepare(out_dir: Path, will_write: list[str], overwrite: bool, meta: dict) -> None:
    """Check that ``out_dir`` may receive ``will_write`` (see the module docstring), remove
    the files of an earlier export (and, with ``overwrite``, the model files in the way)
    and record ``will_write`` in the manifest."""
    if out_dir.exists() and not out_dir.is_dir():
        raise HFError(f"'{out_dir}' is a file; name a folder to export into")
    try:
        ours = set(exported_files(out_dir)) if out_dir.is_dir() else set()
    except HFError:
        if not overwrite:
            raise
        ours = set()  # an unreadable record: --overwrite treats the folder as foreign
    mine = ours | {MANIFEST}
    present = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    foreign = [n for n in present if n not in mine]
    if not ours and MANIFEST not in present:
        in_way = foreign                       # not a folder epscale wrote: only if empty
    else:
        in_way = [n for n in foreign if n in will_write or is_model_file(n)]
    if in_way and not overwrite:
        shown = ", ".join(in_way[:5]) + (f" and {len(in_way) - 5} more" if len(in_way) > 5 else "")
        raise HFError(f"'{out_dir}' holds files epscale did not export ({shown}); export into "
                      "an empty or new folder, or pass --overwrite to replace its model files "
                      "(other files are left alone)")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in sorted(ours | {n for n in in_way if is_model_file(n) or n in will_write}):
        target = out_dir / name
        if target.is_file() or target.is_symlink():
            target.unlink()
        elif target.is_dir():
            raise HFError(f"'{target}' is a folder where the export writes a file; move it")
    record = {**meta, "files": sorted(will_write)}
    (out_dir / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
