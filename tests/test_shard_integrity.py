"""Damaged prepared shards stop a run at start, or at the first batch that reads the
damage, with one clear message and exit status 2 (issue #30, findings 6 and 8): a
flipped byte in a document index or in the head of a token shard is caught by the
pre-launch check without data.verify_shards; an id beyond model.vocab_size further in
is named with its file and offset when it is read. Real files, real flipped bytes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from epscale.cli import main as cli_main
from epscale.training.data.prepare import prepare
from epscale.training.data.shards import HEAD_BYTES
from test_train import REPO, tiny_overrides


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    import argparse, string, textwrap

    root = tmp_path_factory.mktemp("shards")
    docs = root / "docs"  # three real documents, ~150 KB
    docs.mkdir()
    for m in (argparse, string, textwrap):
        (docs / Path(m.__file__).name).write_text(Path(m.__file__).read_text())
    out = root / "p"
    prepare([docs], "bytes", out, workers=1, shard_tokens=100_000, chunk_bytes=50_000,
            val_fraction=0.34, progress=False)
    return out


def _copy(prepared: Path, tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "p"
    shutil.copytree(prepared, out)
    return out, json.loads((out / "manifest.json").read_text())


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _train(tmp_path: Path, data: Path, *options: str, **over) -> list[str]:
    return ["train", "--run-dir", str(tmp_path / "run"), *options,
            *tiny_overrides(tmp_path, **{"data.source": str(data), "model.vocab_size": 320,
                                         "train.steps": 2, "train.ckpt_every": 0,
                                         "train.eval_every": 0, **over})]


@pytest.mark.parametrize("where", ["index", "head"])
def test_a_flipped_byte_in_an_index_or_a_shard_head_stops_the_start(prepared, tmp_path,
                                                                      capsys, where):
    out, manifest = _copy(prepared, tmp_path)
    entry = manifest["splits"]["train"][0]
    assert entry.get("head_sha256")
    damaged = out / entry["index" if where == "index" else "file"]
    _flip(damaged, damaged.stat().st_size // 2 if where == "index" else 100)
    assert cli_main(_train(tmp_path, out)) == 2
    err = capsys.readouterr().err
    assert f"shard '{damaged}' is damaged" in err, err
    assert ("document index" if where == "index" else f"first {HEAD_BYTES:,} bytes") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.timeout(180)
def test_a_token_id_beyond_the_vocab_exits_2_naming_the_shard(prepared, tmp_path):
    """Past the checked head, on two processes: rank 1 reads the bad id in step 1, rank 0
    does not. Both stop (no update from that step), exit 2, the shard and the offset named
    once, no traceback."""
    from epscale.config import load_config
    from epscale.training.data import DataLoader, load_data

    out, manifest = _copy(prepared, tmp_path)
    shard = out / manifest["splits"]["train"][0]["file"]
    cfg = load_config(None, _train(tmp_path, out)[3:])
    B, S = cfg.train.micro_batch_size, cfg.model.seq_len
    loader = DataLoader(load_data(cfg.data, 320), S, B, 1, 1, 2, cfg.data.seed)
    # step 1: samples 0..B-1 go to rank 0, B..2B-1 to rank 1 (one source: window = sample)
    mine, theirs = (set(loader.train.windows(np.arange(lo, lo + B)).tolist())
                    for lo in (B, 0))
    w = next(w for w in sorted(mine) if w * S * 2 > HEAD_BYTES and
             all(abs(w - v) > 1 for v in theirs))
    ids = np.fromfile(shard, dtype="<u2")
    ids[w * S + 10] = 400  # beyond model.vocab_size = 320, past the checked head
    ids.tofile(shard)
    r = subprocess.run([sys.executable, "-m", "epscale", *_train(tmp_path, out, "--nproc", "2",
                                                                  **{"train.preflight": False})],
                       cwd=REPO, capture_output=True, text=True, timeout=170)
    text = r.stdout + r.stderr
    assert r.returncode == 2, text[-4000:]
    assert text.count(f"shard '{shard}' at token {w * S + 10} holds token id 400") == 1, \
        text[-4000:]
    assert "Traceback" not in text, text[-4000:]
