"""``epscale data``: a byte-level BPE trained in the test, ``prepare`` on a small corpus of
every input kind (text folder, .jsonl, .jsonl.gz, Parquet), token and document counts
against the tokenizer's own, byte-identical re-runs at any worker count, an interrupted
run that resumes to the same bytes, and every bad input's error."""

from __future__ import annotations

import gzip
import itertools
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from epscale.cli import main
from epscale.config import DataConfig
from epscale.training.data import (DataError, DataLoader, WindowSampler, load_data,
                                   load_tokenizer, open_prepared, read_manifest, train_bpe,
                                   verify_shards)
from epscale.training.data.prepare import prepare
from epscale.training.data.readers import ReadStats, iter_documents

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SMALL = {"shard_tokens": 6000, "chunk_bytes": 6000, "val_fraction": 0.2, "progress": False}


def stdlib_texts(count: int, skip: int = 0) -> list[str]:
    """Small real Python sources (2-12 KB), in a fixed order."""
    files = sorted(p for p in STDLIB.glob("*.py") if 2000 < p.stat().st_size < 12000)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files[skip:skip + count]]


def make_corpus(root: Path) -> tuple[list[Path], list[str]]:
    """A folder of text files, a .jsonl, a .jsonl.gz and a Parquet file (2 rows per row
    group); returns the inputs and every document's text."""
    texts = stdlib_texts(24)
    root.mkdir(parents=True, exist_ok=True)
    folder = root / "txt"
    folder.mkdir(exist_ok=True)
    for i, t in enumerate(texts[:8]):
        (folder / f"f{i:02d}.py").write_text(t, encoding="utf-8")
    with (root / "a.jsonl").open("w", encoding="utf-8") as f:
        for t in texts[8:16]:
            f.write(json.dumps({"id": 1, "text": t}) + "\n")
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in texts[16:20]:
            f.write(json.dumps({"text": t}) + "\n")
    pq.write_table(pa.table({"text": texts[20:24]}), root / "c.parquet", row_group_size=2)
    return [folder, root / "a.jsonl", root / "b.jsonl.gz", root / "c.parquet"], texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    inputs, texts = make_corpus(root)
    train_bpe(iter_documents(inputs), 400, root / "tok")
    return inputs, texts, root / "tok"


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    inputs, _texts, tok = corpus
    out = tmp_path_factory.mktemp("prep") / "p"
    result = prepare(inputs, tok, out, workers=1, **SMALL)
    return out, result


def test_trained_tokenizer_has_eos_bos_and_is_deterministic(corpus, tmp_path):
    inputs, _texts, tok_dir = corpus
    again = train_bpe(iter_documents(inputs), 400, tmp_path / "again")
    assert (tok_dir / "tokenizer.json").read_bytes() == again.path.read_bytes()
    tok = load_tokenizer(tok_dir)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (400, 0, 1)
    # text that spells the EOS token is text, never the EOS id
    assert tok.eos_id not in tok.encode_batch(["a <|endoftext|> b"])[0]
    with pytest.raises(DataError, match="too small"):
        train_bpe(iter(["x"]), 100, tmp_path / "small")


def test_prepare_counts_match_the_tokenizer_and_decode_back(corpus, prepared):
    _inputs, texts, tok_dir = corpus
    out, result = prepared
    own = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    own_tokens = sum(len(own.encode(t, add_special_tokens=False).ids) for t in texts)
    m = result.manifest
    assert m["documents"]["train"] + m["documents"]["val"] == len(texts)
    assert m["tokens"]["train"] + m["tokens"]["val"] == own_tokens + len(texts)  # + one EOS each
    assert m["documents"]["val"] > 0 and m["dtype"] == "uint16"
    assert len(m["splits"]["train"]) > 2 and m["tokenizer"]["eos_id"] == 0
    assert [s["kind"] for s in m["sources"]].count("text") == 8
    decoded = []
    for split in ("train", "val"):
        for e in m["splits"][split]:
            ids = np.fromfile(out / e["file"], dtype="<u2")
            ends = np.fromfile(out / e["index"], dtype="<u8")
            assert ids.size == e["tokens"] == ends[-1] and ends.size == e["documents"]
            assert np.array_equal(np.flatnonzero(ids == 0), ends - 1)  # EOS ends each document
            bounds = [0] + ends.tolist()
            decoded += [own.decode(ids[a:b - 1].tolist()) for a, b in itertools.pairwise(bounds)]
    assert sorted(decoded) == sorted(texts)  # every document, whole, once


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_prepare_is_byte_identical_across_runs_and_worker_counts(corpus, prepared, tmp_path):
    inputs, _texts, tok = corpus
    out, _result = prepared
    two = prepare(inputs, tok, tmp_path / "two", workers=2, **SMALL)
    assert two.finished and _files(tmp_path / "two") == _files(out)
    again = prepare(inputs, tok, out, workers=2, **SMALL)  # same inputs, same directory
    assert again.up_to_date
    with pytest.raises(DataError, match="other inputs, tokenizer or settings.*--overwrite"):
        prepare(inputs, tok, out, workers=1, **{**SMALL, "val_fraction": 0.3})


def test_interrupted_prepare_resumes_to_the_same_bytes(corpus, prepared, tmp_path):
    inputs, _texts, tok = corpus
    out, _result = prepared
    part = tmp_path / "part"
    first = prepare(inputs, tok, part, workers=1, stop_after_commits=3, **SMALL)
    assert not first.finished and not (part / "manifest.json").exists()
    with pytest.raises(DataError, match="unfinished 'epscale data prepare'"):
        load_data(DataConfig(source=str(part), tokenizer=str(tok)), 512)
    # What a crash leaves behind: a half-written temporary file, a shard renamed after the
    # last commit was recorded, and the last committed shard damaged.
    (part / "train-00003.bin.tmp").write_bytes(b"half")
    (part / "train-00009.bin").write_bytes(b"\x01\x00" * 10)
    state = json.loads((part / ".prepare" / "state.json").read_text())
    last = part / state["commits"][-1]["shards"]["train"][0]["file"]
    data = bytearray(last.read_bytes())
    data[0] ^= 0xFF
    last.write_bytes(bytes(data))
    second = prepare(inputs, tok, part, workers=2, **SMALL)
    assert second.finished and second.resumed_commits == 2  # the damaged commit is redone
    assert _files(part) == _files(out)
    assert not (part / ".prepare").exists()


def test_training_data_reads_the_prepared_shards(corpus, prepared):
    _inputs, _texts, tok = corpus
    out, result = prepared
    mix = load_data(DataConfig(source=str(out), tokenizer=str(out)), 512)
    part = mix.parts[0]
    loader = DataLoader(mix, 32, 2, 1, 0, 1, seed=0)
    assert part.train._maps == {} and part.val._maps == {}  # opened, nothing read or mapped
    loader.next_micro_batch()
    assert 1 <= len(part.train._maps) <= 4 and part.val._maps == {}  # only what 2 windows touch
    assert part.eos_id == 0 and part.train.size == result.manifest["tokens"]["train"]
    first = result.manifest["splits"]["train"][0]
    whole = np.fromfile(out / first["file"], dtype="<u2")
    assert np.array_equal(part.train[0:first["tokens"] + 5][:first["tokens"]], whole)
    # the tokenizer given as the original file, its directory or the prepared copy: one hash
    for spec in (tok, tok / "tokenizer.json", out / "tokenizer.json"):
        load_data(DataConfig(source=str(out), tokenizer=str(spec)), 512)


# --------------------------------------------------------------------------------------
# Bad inputs: each gets an error naming the file and what to do
# --------------------------------------------------------------------------------------


def _bad_input(tmp_path: Path, case: str) -> tuple[Path, dict, str]:
    p = tmp_path / "in.jsonl"
    kw: dict = {}
    if case == "missing":
        p = tmp_path / "nope.txt"
        match = r"input '.*nope\.txt' does not exist"
    elif case == "empty":
        p = tmp_path / "empty.txt"
        p.write_bytes(b"")
        match = r"input '.*empty\.txt' is empty"
    elif case == "broken_gzip":
        p = tmp_path / "x.jsonl.gz"
        p.write_bytes(gzip.compress(b'{"text": "abc"}\n' * 100)[:40])
        match = r"input '.*x\.jsonl\.gz' cannot be read as gzip"
    elif case == "binary":
        p = tmp_path / "w.dat"
        p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(100))
        match = r"input '.*w\.dat' is not text \(NUL bytes"
    elif case == "invalid_utf8_strict":
        p = tmp_path / "latin.txt"
        p.write_bytes("caf\xe9 au lait ".encode("latin-1") * 20)
        kw, match = {"strict": True}, r"input '.*latin\.txt' is not valid UTF-8 \(byte 3"
    elif case == "missing_field":
        p.write_text('{"text": "ok"}\n{"content": "no text field"}\n')
        match = (r"input '.*in\.jsonl' line 2 has no field 'text' \(its fields: content\); "
                 r"choose .* --text-field")
    elif case == "not_json":
        p.write_text('{"text": "ok"}\n{"text": "unterminated\n')
        match = r"input '.*in\.jsonl' line 2 is not valid JSON"
    elif case == "parquet_column":
        p = tmp_path / "t.parquet"
        pq.write_table(pa.table({"body": ["a", "b"]}), p)
        match = r"input '.*t\.parquet' has no column 'text' \(its columns: body\)"
    else:  # no_documents
        p = tmp_path / "blank.jsonl"
        p.write_text('\n{"text": ""}\n\n')
        match = r"hold no documents"
    return p, kw, match


@pytest.mark.parametrize("case", ["missing", "empty", "broken_gzip", "binary",
                                  "invalid_utf8_strict", "missing_field", "not_json",
                                  "parquet_column", "no_documents"])
def test_bad_inputs_are_errors_naming_the_file(tmp_path, case):
    path, kw, match = _bad_input(tmp_path, case)
    with pytest.raises(DataError, match=match):
        prepare([path], "bytes", tmp_path / "out", progress=False, **kw)


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    bad = tmp_path / "latin.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 30)
    good = tmp_path / "ok.txt"
    good.write_text("plain text " * 30)
    folder_bin = tmp_path / "mixed"
    folder_bin.mkdir()
    (folder_bin / "ids.bin").write_bytes(bytes(64))
    (folder_bin / "t.txt").write_text("more text " * 30)
    r = prepare([bad, good, folder_bin], "bytes", tmp_path / "out", progress=False,
                val_fraction=0.0)
    read = r.manifest["read"]
    assert read["invalid_utf8_documents"] == 1 and read["files_not_text"] == 1
    assert r.manifest["documents"]["train"] == 3 and r.manifest["tokenizer"]["eos_id"] == 256
    ids = np.fromfile(tmp_path / "out" / "train-00000.bin", dtype="<u2")
    assert bytes(ids[:6].astype(np.uint8)) == "caf\ufffd".encode()  # U+FFFD replaces it


def test_tokenizer_and_output_errors(corpus, tmp_path):
    inputs, _texts, _tok = corpus
    with pytest.raises(DataError, match=r"tokenizer '.*nothing' does not exist"):
        prepare(inputs, tmp_path / "nothing", tmp_path / "o", progress=False)
    bare = tokenizers.Tokenizer(tokenizers.models.BPE())
    bare.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    bare.train_from_iterator(["some text here"] * 5, tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(DataError, match=r"tokenizer '.*bare\.json' has no end-of-document token"):
        prepare(inputs, tmp_path / "bare.json", tmp_path / "o", progress=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"--out '.*busy' is not empty \(e\.g\. 'notes\.txt'\)"):
        prepare(inputs, "bytes", busy, progress=False)


def test_bad_prepared_data_is_caught_before_training(corpus, prepared, tmp_path):
    _inputs, _texts, tok = corpus
    src, _result = prepared
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    cfg = DataConfig(source=str(out), tokenizer=str(tok))
    # a tokenizer other than the one the data was prepared with
    with pytest.raises(DataError, match=r"was prepared with tokenizer .*tokenizer\.json \(sha256 "
                                        r".*but data\.tokenizer is 'bytes' .*Set data\.tokenizer="):
        load_data(DataConfig(source=str(out)), 512)
    # raw text with a BPE tokenizer: the trainer reads raw text as bytes only
    with pytest.raises(DataError, match=r"is raw text, which the trainer reads as bytes, but "
                                        r"data\.tokenizer is .*epscale data prepare"):
        load_data(DataConfig(source=str(_inputs[0]), tokenizer=str(tok)), 512)
    with pytest.raises(DataError, match=r"data\.sources names '.*' twice"):
        load_data(DataConfig(sources=[str(out), str(out)], tokenizer=str(tok)), 512)
    # the model's vocabulary too small for the tokenizer
    with pytest.raises(DataError, match=r"has 400 token ids but model\.vocab_size is 256; set "
                                        r"model\.vocab_size=448"):
        load_data(cfg, 256)
    # a shard changed after prepare: the SHA-256 check names it (same size: only the hash sees it)
    shard = out / read_manifest(out)["splits"]["train"][1]["file"]
    ids = np.fromfile(shard, dtype="<u2")
    ids[0] = 399 if ids[0] != 399 else 398
    ids.tofile(shard)
    with pytest.raises(DataError, match=rf"shard '.*{shard.name}' does not match its manifest"):
        verify_shards(out)
    # the pre-launch check hashes each shard's head (where this change is) without
    # data.verify_shards: it sees it first
    with pytest.raises(DataError, match="is damaged: the SHA-256 of its first 65,536 bytes"):
        load_data(DataConfig(source=str(out), tokenizer=str(tok), verify_shards=True), 512,
                  thorough=True)
    load_data(cfg, 512)  # without verify_shards start-up reads nothing (sizes only)
    # a token id beyond the vocabulary is caught when a window reads it, naming the shard
    ids[0] = 450
    ids.tofile(shard)
    part = open_prepared(out, load_tokenizer(tok).hash, str(tok), 448)
    sampler = WindowSampler(part.train, 16, seed=0, id_limit=448)
    with pytest.raises(DataError, match=rf"shard '.*{shard.name}' at token 0 holds token id "
                                        r"450, beyond model\.vocab_size=448"):
        sampler.rows(np.arange(sampler.num_windows))
    # a shard cut short
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"shard '.*{shard.name}' has .* bytes, not the .* its "
                                        "manifest says"):
        load_data(cfg, 512)


def test_cli_train_tokenizer_prepare_verify(corpus, tmp_path, capsys):
    inputs, _texts, _tok = corpus
    args = [str(p) for p in inputs]
    assert main(["data", "train-tokenizer", *args, "--vocab", "300", "--out",
                 str(tmp_path / "tok")]) == 0
    printed = capsys.readouterr().out
    assert "trained a byte-level BPE tokenizer of 300 tokens on 24 documents" in printed
    assert main(["data", "prepare", *args, "--tokenizer", str(tmp_path / "tok"), "--out",
                 str(tmp_path / "p"), "--workers", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "prepared 24 documents" in out and "train on it: epscale train data.source=" in out
    assert main(["data", "verify", str(tmp_path / "p")]) == 0
    assert "files match manifest.json" in capsys.readouterr().out
    assert main(["data", "prepare", str(tmp_path / "nope"), "--tokenizer", "bytes",
                 "--out", str(tmp_path / "q")]) == 2
    assert "epscale data: error: input" in capsys.readouterr().err
    stats = ReadStats()
    assert len(list(iter_documents(inputs, stats=stats))) == 24 and stats.documents == 24
