"""benchmarks/ab_revisions.py: a git revision's layer loads as a second package beside the
working tree's and both run side by side (a small shape, one round)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("ab_revisions", ROOT / "benchmarks" / "ab_revisions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git and a git checkout of epscale")
def test_head_against_working_tree(tmp_path, monkeypatch):
    ab = _load_script()
    monkeypatch.setitem(ab.CONFIGS, "tiny", dict(E=8, K=2, D=64, F=96, T=128))
    out = tmp_path / "ab.json"
    try:
        assert ab.main(["--base", "HEAD", "--configs", "tiny", "--rounds", "1", "--reps", "1",
                        "--dtype", "float32", "--json", str(out)]) == 0
    finally:
        sys.modules.pop("epscale_base", None)
    res = json.loads(out.read_text())
    (row,) = res["results"]
    assert row["config"] == "tiny" and row["base_ms"] > 0 and row["new_ms"] > 0
    assert row["out_rel_diff"] < 1e-4  # HEAD's layer computes what the working tree's does


def test_unknown_revision_is_a_clear_error():
    ab = _load_script()
    with pytest.raises(SystemExit, match="cannot read src/epscale at revision 'no-such-rev'"):
        ab.main(["--base", "no-such-rev", "--configs", "narrow"])


def test_base_from_a_source_directory(tmp_path, monkeypatch):
    """--base DIR takes a revision's src/epscale from a directory (a device machine has no
    git history): here a copy of the working tree's, which computes the same layer."""
    ab = _load_script()
    monkeypatch.setitem(ab.CONFIGS, "tiny", dict(E=8, K=2, D=64, F=96, T=128))
    shutil.copytree(ROOT / "src" / "epscale", tmp_path / "base" / "src" / "epscale",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    try:
        assert ab.main(["--base", str(tmp_path / "base"), "--configs", "tiny", "--rounds", "1",
                        "--reps", "1", "--dtype", "float32", "--json", str(out)]) == 0
    finally:
        sys.modules.pop("epscale_base", None)
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["results"][0]["out_rel_diff"] < 1e-4
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty/src/epscale/__init__.py is not there"):
        ab.main(["--base", str(tmp_path / "empty"), "--configs", "tiny"])
