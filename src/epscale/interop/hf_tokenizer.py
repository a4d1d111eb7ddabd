"""The tokenizer files of a Hugging Face export, so that ``AutoTokenizer.from_pretrained``
reads the folder alone and ``generate`` stops where ``epscale generate`` does.

Where the run's tokenizer comes from, first found:

1. ``data.tokenizer`` naming a ``tokenizer.json`` (``epscale data train-tokenizer`` or any
   Hugging Face one): copied, with a ``tokenizer_config.json`` (``PreTrainedTokenizerFast``,
   its EOS/BOS, padding with EOS) and ``special_tokens_map.json``;
2. an import's ``RUN_DIR/hf_source/`` (the hub's own tokenizer files, copied unchanged;
   token ids from its config.json);
3. ``bytes`` (ids 0-255 are UTF-8 bytes): a byte-level ``tokenizer.json`` written here
   that encodes and decodes exactly as epscale does (EOS 256 / BOS 257 when the
   vocabulary holds them, else none).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ..config import RunConfig
from ..training.data import tokenizer as data_tokenizer
from ..training.data.errors import DataError
from .files import read_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
BYTE_EOS, BYTE_BOS = data_tokenizer.TRAINED_EOS, data_tokenizer.TRAINED_BOS


@dataclass
class TokenizerFiles:
    """File name -> text to write, and the special token ids (None where there is none)."""

    files: dict[str, str] = field(default_factory=dict)
    bos: int | None = None
    eos: int | list[int] | None = None   # an imported model may stop at several
    pad: int | None = None
    source: str = "none"

    def ids(self) -> dict[str, int | list[int] | None]:
        return {"bos": self.bos, "eos": self.eos, "pad": self.pad}


def _first(value):
    return value[0] if isinstance(value, list) and value else value


def byte_level_json(vocab_size: int) -> tuple[str, int | None, int | None]:
    """A tokenizer.json whose ids 0-255 are the UTF-8 bytes (GPT-2's byte-to-character
    alphabet, no merges), plus EOS 256 / BOS 257 when ``vocab_size`` holds them."""
    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eos = bos = None
    if vocab_size >= 258:
        tok.add_special_tokens([BYTE_EOS, BYTE_BOS])
        eos, bos = tok.token_to_id(BYTE_EOS), tok.token_to_id(BYTE_BOS)
        assert (eos, bos) == (data_tokenizer.ByteTokenizer.eos_id,
                              data_tokenizer.ByteTokenizer.bos_id)
    return tok.to_str(), eos, bos


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _fast_config(tok_json: Path | None, names: dict[str, str | None], seq_len: int) -> dict:
    """tokenizer_config.json: the one beside ``tok_json`` (when there is one) completed with
    the class and special tokens transformers needs."""
    base = {}
    beside = tok_json.parent / "tokenizer_config.json" if tok_json is not None else None
    if beside is not None and beside.is_file():
        base = read_json(beside)
    base.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key, value in names.items():
        if value is not None:
            base.setdefault(key, value)
    base.setdefault("model_max_length", seq_len)
    return base


def _special_map(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if config.get(k) is not None}


def tokenizer_files(source_dir: Path | None, cfg: RunConfig,
                    report: Callable[[str], None], byte_level: bool = True) -> TokenizerFiles:
    """The tokenizer files and token ids of the run (see the module docstring;
    ``source_dir``: RUN_DIR/hf_source, None for a model with no run directory;
    ``byte_level``: write the byte-level tokenizer for a ``bytes`` run)."""
    spec = cfg.data.tokenizer
    if spec != "bytes":
        try:
            tok = data_tokenizer.load_tokenizer(spec, require_eos=False)
        except DataError as e:
            report(f"warning: the run's tokenizer (data.tokenizer = {spec!r}) cannot be read "
                   f"({e}); the export has no tokenizer files")
            return TokenizerFiles()
        vocab = tok.tok.get_vocab(with_added_tokens=True)
        inverse = {i: t for t, i in vocab.items()}
        eos = inverse.get(tok.eos_id) if tok.eos_id is not None else None
        bos = inverse.get(tok.bos_id) if tok.bos_id is not None else None
        config = _fast_config(tok.path, {"eos_token": eos, "bos_token": bos, "pad_token": eos},
                              cfg.model.seq_len)
        out = TokenizerFiles(bos=tok.bos_id, eos=tok.eos_id, pad=tok.eos_id, source=str(tok.path))
        out.files["tokenizer.json"] = tok.path.read_text(encoding="utf-8")
        out.files["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
        out.files["special_tokens_map.json"] = json.dumps(_special_map(config), indent=2) + "\n"
        return out
    if source_dir is not None and (source_dir / "config.json").is_file():
        out = TokenizerFiles(source=f"{source_dir} (the imported model's)")
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file():
                out.files[name] = (source_dir / name).read_text(encoding="utf-8")
        if not out.files:
            out.source = "none (the imported model came without tokenizer files)"
            report("warning: the imported model came without tokenizer files; the export has "
                   "none either (set data.tokenizer to the tokenizer.json to include one)")
        hf = read_json(source_dir / "config.json")
        out.bos, out.eos = hf.get("bos_token_id"), hf.get("eos_token_id")
        out.pad = hf.get("pad_token_id") if hf.get("pad_token_id") is not None else \
            _first(out.eos)
        return out
    if not byte_level:
        return TokenizerFiles()
    if cfg.model.vocab_size < 256:
        report(f"warning: a 'bytes' run with model.vocab_size = {cfg.model.vocab_size} < 256: "
               "its ids are not bytes, so the export has no tokenizer files")
        return TokenizerFiles()
    text, eos, bos = byte_level_json(cfg.model.vocab_size)
    names = {"eos_token": BYTE_EOS if eos is not None else None,
             "bos_token": BYTE_BOS if bos is not None else None,
             "pad_token": BYTE_EOS if eos is not None else None}
    config = _fast_config(None, names, cfg.model.seq_len)
    out = TokenizerFiles(bos=bos, eos=eos, pad=eos, source="bytes (UTF-8 bytes as ids 0-255)")
    out.files["tokenizer.json"] = text
    out.files["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
    out.files["special_tokens_map.json"] = json.dumps(_special_map(config), indent=2) + "\n"
    return out


def generation_config(ids: dict[str, int | list[int] | None], source_dir: Path | None) -> str:
    """generation_config.json: the token ids ``generate`` starts, stops and pads with (over
    an imported model's own generation_config.json, whose other settings are kept)."""
    f = source_dir / "generation_config.json" if source_dir is not None else None
    base = read_json(f) if f is not None and f.is_file() else {}
    base.update({f"{k}_token_id": v for k, v in ids.items()})
    return json.dumps(base, indent=2, sort_keys=True) + "\n"
