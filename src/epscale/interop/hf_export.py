"""epscale -> Hugging Face: a checkpoint (or a model in memory) as a folder that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read with
no extra argument, computing the same logits.

    export_hf("runs/x", "out_dir")          # newest checkpoint, written at any layout
    to_pretrained(model, cfg, "out_dir")    # an unparallelized model

The family is the first that holds the model exactly (:mod:`epscale.interop.hf_families`);
where none does, the export is refused (an HFError with every family's reasons) unless
``lossy``, which writes the closest one and warns naming what is dropped. The folder gets
config.json, the safetensors shards (+ index), generation_config.json (bos/eos/pad) and
the run's tokenizer files (:mod:`epscale.interop.hf_tokenizer`), and is written only
where :mod:`epscale.interop.export_dir` allows.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import RunConfig
from ..training import checkpoint as ckpt
from ..training.checkpoint.state import saved_keys
from . import export_dir
from .files import DTYPES, INDEX, HFError, plan_shards, shard_name, write_shards
from .hf import (
    DEFAULT_SHARD_BYTES,
    SOURCE_DIR,
    load_tensors,
    model_shapes,
    rules,
    run_config,
    source_config,
)
from .hf_config_out import hf_from_recipe
from .hf_families import BIAS_FAMILIES, Fit, choose, needs_bias
from .hf_tokenizer import TokenizerFiles, generation_config, tokenizer_files


def _dtype_of(hf_name: str, dtype: torch.dtype, family: str) -> torch.dtype:
    """The score-correction bias stays fp32 (as the hub's DeepSeek-V3 keeps it: a bias
    step of 1e-3 on sigmoid scores is below bf16's resolution near 1), and so does the
    router's gate where the family computes it in fp32 (its ``_keep_in_fp32_modules``),
    as epscale does: a bf16 export then routes as the fp32 model."""
    if hf_name.endswith("e_score_correction_bias"):
        return torch.float32
    if family in BIAS_FAMILIES and hf_name.endswith(".mlp.gate.weight"):
        return torch.float32
    return dtype


def _bias_nonzero(biases: dict[str, torch.Tensor]) -> bool:
    return any(bool(t.abs().max() > 0) for t in biases.values())


def _choose(cfg: RunConfig, family: str | None, prefer: str | None, bias_nonzero: bool,
            lossy: bool, warn: Callable[[str], None]) -> Fit:
    f = choose(cfg, family, prefer, needs_bias(cfg, bias_nonzero), lossy)
    for what in f.dropped:
        warn(f"--lossy: written as {f.family} without {what}")
    return f


def _write(out_dir: Path, fit: Fit, cfg: RunConfig, dtype: str, source: dict | None,
           tok: TokenizerFiles, source_dir: Path | None, shards: list[list[str]], produce,
           overwrite: bool, meta: dict) -> list[str]:
    """Everything the folder gets, in an order that leaves a recognisable export behind
    if interrupted (manifest, weights, then config and tokenizer). Returns the files."""
    same = source if source and source.get("model_type") == fit.family else None
    hf_cfg = hf_from_recipe(cfg, fit.family, dtype, same, tok.ids())
    weights = [shard_name(i, len(shards)) for i in range(len(shards))]
    if len(shards) > 1:
        weights.append(INDEX)
    names = weights + ["config.json", "generation_config.json", *tok.files]
    export_dir.prepare(out_dir, names, overwrite, {**meta, "family": fit.family,
                                                   "dropped": fit.dropped})
    write_shards(out_dir, produce(), len(shards))
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True))
    (out_dir / "generation_config.json").write_text(generation_config(tok.ids(), source_dir))
    for name, text in tok.files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return sorted(names + [export_dir.MANIFEST])


def export_hf(source: str | Path, out_dir: str | Path, family: str | None = None,
              dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              report: Callable[[str], None] = print, lossy: bool = False,
              overwrite: bool = False) -> Path:
    """Write the newest checkpoint of run directory ``source`` (or a checkpoint
    directory) as a Hugging Face model folder (see the module docstring). Reads one
    shard's tensors at a time from the sharded checkpoint (whatever layout wrote it), so
    memory peaks at one output shard (or one stacked expert tensor when that is larger).
    ``family``: --arch; ``lossy``: write even when the family drops something;
    ``overwrite``: replace the model files of a folder epscale did not export into."""
    path = ckpt.resolve(source)
    meta = ckpt.validate(path)
    cfg = run_config(path, meta)
    src_cfg = source_config(path)
    dtype = dtype or ((src_cfg or {}).get("dtype") or (src_cfg or {}).get("torch_dtype")
                      or "float32")
    if dtype not in DTYPES:
        raise HFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    saved = saved_keys(path)
    shapes = {key[len("model."):]: (tuple(md.size), md.properties.dtype)
              for key, md in saved.items() if key.startswith("model.")}
    want = model_shapes(cfg)
    for name, shape in want.items():
        if name not in shapes or shapes[name][0] != shape:
            raise HFError(f"checkpoint '{path}' does not fit its own config: '{name}' is "
                          f"{shapes.get(name, ('missing',))[0]} there, {shape} in the model")
    biases = load_tensors(path, {n: shapes[n] for n in want if n.endswith("router.expert_bias")})
    fit = _choose(cfg, family, (src_cfg or {}).get("model_type"), _bias_nonzero(biases), lossy,
                  lambda w: report(f"warning: {w}"))
    rs = rules(want, cfg, fit.family, interleave=True)
    out_dtype = DTYPES[dtype]
    by_name = {r.name: r for r in rs}
    shards = plan_shards(((r.name, sum(map(math.prod, r.hf_shapes)) * out_dtype.itemsize)
                          for r in rs), max_shard_bytes)
    run_dir = path.parent.parent
    tok = tokenizer_files(run_dir / SOURCE_DIR, cfg, report)

    def produce():
        for names in shards:
            loaded = load_tensors(path, {n: shapes[n] for n in names})
            yield {h: t.to(_dtype_of(h, out_dtype, fit.family)) for n in names
                   for h, t in zip(by_name[n].hf, by_name[n].to_hf(loaded.pop(n)))}

    out_dir = Path(out_dir)
    files = _write(out_dir, fit, cfg, dtype, src_cfg, tok, run_dir / SOURCE_DIR, shards,
                   produce, overwrite, {"checkpoint": str(path), "step": meta.get("step")})
    report(f"exported {path} as {fit.family}{' (lossy)' if fit.dropped else ' (exact)'} to "
           f"{out_dir}: {', '.join(files)}; tokenizer: {tok.source}")
    return out_dir


def to_pretrained(model, cfg: RunConfig, path: str | Path, family: str | None = None,
                  dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  lossy: bool = False, overwrite: bool = False) -> Path:
    """Write an (unparallelized) epscale model as a Hugging Face folder that
    ``AutoModelForCausalLM.from_pretrained`` reads, with the tokenizer files of
    ``cfg.data.tokenizer`` when it names a tokenizer.json (a model in memory may come
    from anywhere, so 'bytes' writes none); families, ``lossy`` and ``overwrite`` as
    :func:`export_hf`; what --lossy drops is a UserWarning."""
    state = {k: v.detach().cpu().float() for k, v in model.state_dict().items()}
    biases = {k: v for k, v in state.items() if k.endswith("router.expert_bias")}
    fit = _choose(cfg, family, None, _bias_nonzero(biases), lossy,
                  lambda w: warnings.warn(w, stacklevel=3))
    rs = rules({k: tuple(v.shape) for k, v in state.items()}, cfg, fit.family, interleave=True)
    out_dtype = DTYPES[dtype]
    shards = plan_shards([(r.name, sum(math.prod(s) for s in r.hf_shapes) * out_dtype.itemsize)
                          for r in rs], max_shard_bytes)
    by_name = {r.name: r for r in rs}
    path = Path(path)
    tok = tokenizer_files(None, cfg, lambda m: warnings.warn(m, stacklevel=3), byte_level=False)

    def produce():
        for names in shards:
            yield {h: t.to(_dtype_of(h, out_dtype, fit.family)) for n in names
                   for h, t in zip(by_name[n].hf, by_name[n].to_hf(state[n]))}

    _write(path, fit, cfg, dtype, None, tok, None, shards, produce, overwrite,
           {"checkpoint": None})
    return path


__all__ = ["export_hf", "to_pretrained"]
