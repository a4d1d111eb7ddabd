"""Data sources (stdlib, text, .bin memmaps), the train/validation split, clear errors that
name the path, and the deterministic, resumable, disjoint-per-rank sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epscale.config import DataConfig
from epscale.training.data import (TEXT_PROBE_BYTES, DataError, DataLoader, Splits, WindowSampler, _is_val,
                                   binary_reason, list_text_files, load_splits, stdlib_root)


def test_stdlib_split_is_deterministic_and_by_file():
    cfg = DataConfig(source="stdlib", val_fraction=0.05)
    a = load_splits(cfg, 256)
    b = load_splits(cfg, 256)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.train.dtype == np.uint8 and a.train.size > 1_000_000
    frac = a.val.size / (a.val.size + a.train.size)
    assert 0.01 < frac < 0.15
    root = stdlib_root()
    files = list_text_files(root, "*.py")
    assert all("site-packages" not in p.parts for p in files)
    val_files = [p for p in files if _is_val(p.relative_to(root).as_posix(), 0.05)]
    assert 0 < len(val_files) < len(files)
    # the first validation file's bytes sit at the start of the validation split
    first = next(p.read_bytes() for p in val_files if p.stat().st_size > 0)
    assert bytes(a.val[:len(first)]) == first


def test_text_folder_and_single_file(tmp_path):
    folder = tmp_path / "txt"
    (folder / "sub").mkdir(parents=True)
    for i in range(40):
        (folder / ("sub" if i % 2 else "") / f"f{i}.txt").write_text(f"file {i} " * 50)
    (folder / ".hidden").write_text("never read")
    s = load_splits(DataConfig(source=str(folder), val_fraction=0.2), 256)
    assert s.train.size + s.val.size == sum(len(f"file {i} " * 50) for i in range(40))
    assert b"never" not in bytes(s.train) + bytes(s.val)
    one = tmp_path / "one.txt"
    one.write_text("abcdefghij" * 100)
    s1 = load_splits(DataConfig(source=str(one), val_fraction=0.1), 256)
    assert s1.train.size == 900 and s1.val.size == 100
    assert bytes(s1.val[:10]) == b"abcdefghij"


def test_bin_memmaps(tmp_path):
    tokens = (np.arange(5000) % 1000).astype(np.uint16)
    tokens.tofile(tmp_path / "data.bin")
    s = load_splits(DataConfig(source=str(tmp_path / "data.bin"), dtype="uint16", val_fraction=0.1), 1000)
    assert isinstance(s.train, np.memmap) and s.train.size == 4500 and s.val.size == 500
    d = tmp_path / "nano"
    d.mkdir()
    (np.arange(3000) % 70000).astype(np.uint32).tofile(d / "train.bin")
    (np.arange(300) % 70000).astype(np.uint32).tofile(d / "val.bin")
    s2 = load_splits(DataConfig(source=str(d), dtype="uint32"), 70000)
    assert s2.train.size == 3000 and s2.val.size == 300 and s2.train.dtype == np.uint32
    x, y = WindowSampler(s2.train, 16, seed=0).batch(0, 2)
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("case", ["missing", "empty_file", "empty_folder", "beyond_vocab",
                                  "bad_size", "small_vocab_text", "too_short"])
def test_errors_name_the_path(tmp_path, case):
    path = tmp_path / "x.txt"
    vocab, dtype, seq = 256, "uint16", None
    if case == "missing":
        path = tmp_path / "does_not_exist.txt"
        match = "does not exist"
    elif case == "empty_file":
        path.write_bytes(b"")
        match = "empty"
    elif case == "empty_folder":
        path = tmp_path / "folder"
        path.mkdir()
        match = "no files"
    elif case == "beyond_vocab":
        path = tmp_path / "t.bin"
        np.array([1, 2, 300, 4] * 10, dtype=np.uint16).tofile(path)
        match = "token id 300 at index 2, beyond model.vocab_size=256"
    elif case == "bad_size":
        path = tmp_path / "t.bin"
        path.write_bytes(b"\x01\x02\x03")
        match = "not a multiple of 2"
    elif case == "small_vocab_text":
        path.write_text("hello" * 100)
        vocab, match = 100, "vocab_size >= 256"
    else:
        path.write_text("short text here")
        seq, match = 64, "fewer than model.seq_len"
    with pytest.raises(DataError, match=match) as info:
        splits = load_splits(DataConfig(source=str(path), dtype=dtype), vocab)
        if seq is not None:
            DataLoader(splits, seq, 1, 1, 0, 1, 0)
    assert str(path) in str(info.value)


def global_batches(loaders: list, steps: int, accum: int) -> list[torch.Tensor]:
    """``steps`` global batches drawn through one DataLoader per rank (micro-batch by
    micro-batch, rank by rank), each the concatenation of every rank's inputs."""
    out = []
    for _step in range(steps):
        rows = []
        for _m in range(accum):
            for ld in loaders:
                rows.append(ld.next_micro_batch()[0])
        for ld in loaders:
            ld.end_step()
        out.append(torch.cat(rows))
    return out


def _splits(n=20000, seed=0):
    rng = np.random.default_rng(seed)
    return Splits(rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, 3000, dtype=np.uint8), "rand")


def test_ranks_read_disjoint_windows_and_resharding_keeps_the_global_batch():
    s = _splits()

    def step_batches(world, B, accum=1):
        loaders = [DataLoader(s, 32, B, accum, r, world, seed=5) for r in range(world)]
        return global_batches(loaders, 3, accum)

    two = step_batches(2, 2)
    one = step_batches(1, 4)
    four = step_batches(4, 1)
    for a, b, c in zip(two, one, four):
        key = lambda t: sorted(map(tuple, t.tolist()))  # same set of sequences each step
        assert key(a) == key(b) == key(c)
        assert len(set(map(tuple, a.tolist()))) == 4  # disjoint across ranks
    assert not torch.equal(two[0], two[1])  # and new data every step


def test_position_resumes_exactly_and_epochs_reshuffle():
    s = _splits(n=32 * 10 + 1)
    a = DataLoader(s, 32, 2, 1, 0, 1, seed=1)
    for _ in range(3):
        a.next_micro_batch()
        a.end_step()
    state = a.state_dict()
    expect = a.next_micro_batch()
    b = DataLoader(s, 32, 2, 1, 0, 1, seed=1)
    b.load_state_dict(state)
    got = b.next_micro_batch()
    assert torch.equal(expect[0], got[0]) and torch.equal(expect[1], got[1])
    sampler = WindowSampler(s.train, 32, seed=1)
    assert sampler.num_windows == 10
    epoch0 = [sampler._window(g) for g in range(10)]
    epoch1 = [sampler._window(g) for g in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1


def test_validation_batches_are_fixed_and_disjoint():
    s = _splits()
    r0 = DataLoader(s, 32, 2, 1, 0, 2, seed=0).val_batches(3)
    r1 = DataLoader(s, 32, 2, 1, 1, 2, seed=0).val_batches(3)
    again = DataLoader(s, 32, 2, 1, 0, 2, seed=9).val_batches(3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(r0, again))
    rows = [tuple(x.tolist()) for xb, _ in r0 + r1 for x in xb]
    assert len(set(rows)) == len(rows)


# --------------------------------------------------------------------------------------
# Files that are not text (issue #24): skipped in a folder with a note, an error when
# nothing is left or when the one file given is binary.
# --------------------------------------------------------------------------------------

PNG_HEAD = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4


def test_binary_reason_is_a_nul_in_the_first_8_kib():
    assert binary_reason(b"plain text\n") is None
    assert binary_reason("caf\xe9 latin-1".encode("latin-1")) is None  # text, just not UTF-8
    assert binary_reason(PNG_HEAD) == "NUL bytes in its first 8 KiB"
    assert binary_reason("utf-16 text".encode("utf-16")) is not None
    assert binary_reason(b"x" * TEXT_PROBE_BYTES + b"\0") is None  # only the start is read


def test_folder_skips_files_that_are_not_text_with_a_note(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for i in range(10):
        (folder / f"f{i}.txt").write_text(f"text {i} " * 40)
    (folder / "a_logo.png").write_bytes(PNG_HEAD)
    (np.arange(500) % 256).astype(np.uint16).tofile(folder / "ids.bin")
    s = load_splits(DataConfig(source=str(folder), val_fraction=0.2), 256)
    assert s.train.size + s.val.size == sum(len(f"text {i} " * 40) for i in range(10))
    assert b"\0" not in bytes(s.train) + bytes(s.val)
    assert "10 under" in s.description
    assert "skipped 2 that are not text, e.g. a_logo.png (NUL bytes" in s.description


def test_folder_without_text_is_an_error_naming_it(tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir()
    for i in range(12):
        (np.arange(300) % 256).astype(np.uint16).tofile(folder / f"a{i:02d}.bin")
    with pytest.raises(DataError, match=r"holds 12 files, none of them text \(e\.g\. a00\.bin: "
                                        r"NUL bytes.*\.bin file of data\.dtype ids") as info:
        load_splits(DataConfig(source=str(folder)), 256)
    assert str(folder) in str(info.value)
    (folder / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"holds 13 files, none of them non-empty text "
                                        r"\(12 not text, e\.g\. a00\.bin.*; 1 empty\)"):
        load_splits(DataConfig(source=str(folder)), 256)


def test_single_binary_file_is_an_error(tmp_path):
    path = tmp_path / "weights.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00v\x00" + bytes(4096))
    with pytest.raises(DataError, match=r"data file '.*weights\.npy' is not text \(NUL bytes"
                                        r".*\.bin file of data\.dtype ids"):
        load_splits(DataConfig(source=str(path)), 256)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("d\xe9j\xe0 vu ".encode("latin-1") * 100)
    s = load_splits(DataConfig(source=str(latin)), 256)  # text that is not UTF-8 still loads
    assert s.train.size + s.val.size == 800
