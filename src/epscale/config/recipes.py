"""Loading recipes: a YAML file or a recipe name, with ``key=value`` overrides; the
model-family recipes shipped with the package and their published sizes; the CPU-size
shrink.

A recipe is a YAML file in the :class:`~epscale.config.schema.RunConfig` schema. The
family recipes are package data (``epscale/config/recipes/*.yaml``; the repository's
``configs/`` links there), so they are found by name after a plain ``pip install``.
``scale: tiny`` (or the override ``scale=tiny``) runs :func:`shrink` on it after loading
(command-line overrides then apply on top), which keeps what makes the family what it is
(routed/shared experts, top-k, score function, group-limited routing, dense layers in
front, MoE every n-th layer, attention kind and GQA ratio, capacity factor, balancing)
and makes every width CPU sized.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from .io import (RENAMED_KEYS, apply_overrides, directory_message, load_yaml, migrate_renamed_keys,
                 parse_override, renamed_override)
from .schema import ModelConfig, RunConfig
from .validate import ConfigError, from_dict, to_dict

RECIPE_DIR = Path(__file__).resolve().parent / "recipes"

# What to do instead of giving a config file that sets nothing.
EMPTY_CONFIG_HINT = "to train on the built-in defaults leave out --config"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                cls: type = RunConfig) -> Any:
    """Load a recipe (``RunConfig`` by default) from YAML with dotted overrides.

    The ``moe.dim`` key follows ``model.dim`` unless set explicitly. Keys that were
    renamed (:data:`epscale.config.io.RENAMED_KEYS`) are read under their new name. An
    error ends with where its key came from: ``(in PATH)`` for the file, ``(from the
    command-line override 'k=v')`` for an override (:class:`_Origins`). A file that sets
    nothing is an error (use no file for the defaults).
    """
    overrides = list(overrides or [])
    origins = _Origins(path, overrides)
    data = load_yaml(path, empty_hint=EMPTY_CONFIG_HINT) if path is not None else {}
    data = apply_overrides(data, overrides)
    data = migrate_renamed_keys(data, lambda *keys: origins.where(*keys, renamed=False))
    if cls is RunConfig:
        model_dim = (data.get("model") or {}).get("dim", ModelConfig.dim)
        if isinstance(data.get("moe", {}), dict):
            data.setdefault("moe", {}).setdefault("dim", model_dim)
    try:
        cfg = from_dict(cls, data)
        if cls is RunConfig and cfg.scale == "tiny":
            cfg = apply_scale(cfg, overrides)
    except ConfigError as e:
        raise ConfigError(f"{e}{origins.where(*_keys_named(str(e), origins))}") from None
    return cfg


class _Origins:
    """Where the keys of a config being loaded came from: the last command-line override
    that set a key (or a section above or below it), else the file (else the defaults).

    ``renamed=True`` looks keys up under their current names (an override of an old name
    set the new key); ``renamed=False`` under the names written (for the migration itself).
    """

    def __init__(self, path: str | Path | None, overrides: list[str]):
        self.path = path
        self.written = [(".".join(parse_override(t)[0]), t) for t in overrides]
        self.current = [(RENAMED_KEYS.get(key, key), t) for key, t in self.written]

    def override_for(self, key: str, renamed: bool = True) -> str | None:
        """The last override that set ``key``, a section holding it or a key inside it."""
        hit = None
        for k, text in self.current if renamed else self.written:
            if k == key or key.startswith(k + ".") or k.startswith(key + "."):
                hit = text
        return hit

    def override_keys(self) -> list[str]:
        return [k for k, _ in self.current]

    def where(self, *keys: str, renamed: bool = True) -> str:
        """The suffix naming where ``keys`` came from: ``' (in PATH)'``, ``' (from the
        command-line override 'k=v')'``, both, or '' (defaults, no file). No keys: the file."""
        texts, from_file = [], not keys
        for key in keys:
            text = self.override_for(key, renamed)
            if text is None:
                from_file = True
            elif text not in texts:
                texts.append(text)
        over = ""
        if texts:
            s = "s" if len(texts) > 1 else ""
            over = f"the command-line override{s} " + " and ".join(f"'{t}'" for t in texts)
        in_file = from_file and self.path is not None
        if over and in_file:
            return f" (in {self.path}, with {over})"
        if over:
            return f" (from {over})"
        return f" (in {self.path})" if in_file else ""


_SUBJECT_RX = re.compile(r"config (?:key|keys|section) '([^']+)'")


def _keys_named(message: str, origins: _Origins) -> list[str]:
    """The dotted keys a ConfigError is about: its subject (the first quoted key, as
    :func:`~epscale.config.validate.fail` and ``from_dict`` write it; 'moe.a/b' names
    moe.a and moe.b) and the overridden keys its text names (the other side of a clash)."""
    m = _SUBJECT_RX.search(message)
    keys = []
    if m:
        first, *rest = m.group(1).split("/")
        section = first.rsplit(".", 1)[0] + "." if "." in first else ""
        keys = [first] + [section + r for r in rest]
    for key in origins.override_keys():
        if "." in key and key not in keys and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", message):
            keys.append(key)
    return keys

# Published total / active parameters (without MTP modules or vision towers), and where
# they come from. ``None`` where the family's release gives no figure.
PUBLISHED: dict[str, dict] = {
    "mixtral-8x7b": {"total": 46.7e9, "active": 12.9e9,
                     "source": "Mixtral of Experts (Jiang et al. 2024): 46.7B total, 12.9B active"},
    "deepseek-v3": {"total": 671e9, "active": 37e9,
                    "source": "DeepSeek-V3 Technical Report (2024): 671B total, 37B activated "
                              "per token (the 14B MTP module excluded)"},
    "qwen3-30b-a3b": {"total": 30.5e9, "active": 3.3e9,
                      "source": "Qwen3 model card: 30.5B total, 3.3B activated"},
    "glam-64e": {"total": 1.2e12, "active": 96.6e9,
                 "source": "GLaM (Du et al. 2022) Table 4, GLaM (64B/64E): 1.2T total, 96.6B "
                           "activated"},
    "switch-base-128": {"total": 7.4e9, "active": None,
                        "source": "Switch Transformers (Fedus et al. 2022): Switch-Base 128 "
                                  "experts, 7.4B parameters (encoder-decoder)"},
    "ref-1t-64e": {"total": 1.0e12, "active": None,
                   "source": "epscale reference design: 1T parameters, 64 experts (the "
                             "field-report scale: 64 experts over 1,024 H100s)"},
}

RECIPES: tuple[str, ...] = tuple(PUBLISHED)


def recipe_path(name_or_path: str | Path) -> Path:
    """A recipe name ('mixtral-8x7b') or a path to a YAML file -> the file's path. A
    directory that is not also a recipe name is an error saying so."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = RECIPE_DIR / f"{name_or_path}.yaml"
    if cand.is_file():
        return cand
    known = sorted(f.stem for f in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
    recipes = ', '.join(known) or '(none found in ' + str(RECIPE_DIR) + ')'
    if p.is_dir():
        raise ConfigError(f"{directory_message(p)}, or a recipe name; recipes: {recipes}")
    raise ConfigError(f"config file '{name_or_path}' does not exist and is not a recipe name; "
                      f"recipes: {recipes}")


def requested_scale(name_or_path: str | Path, overrides: list[str] | None = None) -> str:
    """The scale a recipe and its overrides ask for: the last ``scale=`` override, else the
    file's ``scale`` key, else 'full'. A loaded config says 'full' once shrunk (so that a
    run's config.yaml re-loads unchanged); this says what was asked, e.g. 'tiny'."""
    scale = load_yaml(recipe_path(name_or_path), empty_hint=EMPTY_CONFIG_HINT).get("scale", "full")
    for text in overrides or []:
        path, value = parse_override(text)
        if path == ["scale"]:
            scale = value
    return scale


def load_recipe(name_or_path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe by name or path, with ``key=value`` overrides (``scale=tiny`` too)."""
    return load_config(recipe_path(name_or_path), overrides or [])


# ----------------------------------------------------------------------------- shrink

TINY_DIM = 64
TINY_VOCAB = 256
TINY_SEQ = 64
TINY_MAX_EXPERTS = 64
TINY_MAX_HEADS = 8


def _round8(x: float) -> int:
    return max(8, int(round(x / 8.0)) * 8)


def shrink(cfg: RunConfig) -> RunConfig:
    """The same family at CPU size (idempotent: shrinking a tiny config changes nothing).

    Widths scale with ``64 / model.dim`` (rounded to multiples of 8, at least 8), so the
    expert/dense/shared width ratios survive; experts are capped at 64 (top-k, groups and
    kept groups unchanged when they still divide), heads at 8 with the GQA ratio kept,
    per-head dims at 16 (rotary part 8), at most one dense leading layer and two MoE
    layers (with ``moe_every`` kept), vocabulary 256, sequence 64, one process (replicated,
    no recomputation).
    """
    m, e = cfg.model, cfg.moe
    s = TINY_DIM / m.dim
    heads = min(m.num_heads, TINY_MAX_HEADS)
    kv = m.num_kv_heads or m.num_heads
    kv_tiny = max(1, heads * kv // m.num_heads) if m.num_kv_heads else None
    dense_layers = min(m.num_dense_layers, 1)
    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    layers = dense_layers + m.moe_every * min(max(n_moe, 1), 2)
    if n_moe == 0:
        layers = dense_layers or 2
    head_dim = min(m.head_dim, 16) if m.head_dim else None
    if head_dim is None and TINY_DIM % heads:
        head_dim = 16
    model = dataclasses.replace(
        m, vocab_size=TINY_VOCAB, dim=TINY_DIM, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_tiny, head_dim=head_dim, seq_len=min(m.seq_len, TINY_SEQ),
        dense_hidden_dim=_round8(m.dense_hidden_dim * s), num_dense_layers=dense_layers,
        q_lora_rank=_round8(m.q_lora_rank * s) if m.q_lora_rank else 0,
        kv_lora_rank=_round8(m.kv_lora_rank * s),
        qk_nope_head_dim=min(m.qk_nope_head_dim, 16), qk_rope_head_dim=min(m.qk_rope_head_dim, 8),
        v_head_dim=min(m.v_head_dim, 16))
    experts = min(e.num_experts, TINY_MAX_EXPERTS)
    groups, kept = e.num_groups, e.topk_groups
    if groups and (experts % groups or kept * (experts // groups) < e.top_k):
        groups = kept = 0
    moe = dataclasses.replace(
        e, dim=TINY_DIM, hidden_dim=_round8(e.hidden_dim * s), num_experts=experts,
        shared_hidden_dim=_round8(e.shared_hidden_dim * s) if e.shared_hidden_dim else None,
        num_groups=groups, topk_groups=kept)
    parallel = dataclasses.replace(cfg.parallel, dp=1, ep=1, ranks_per_node=None, fsdp=False,
                                   dp_replicate=1, dp_shard=None, zero=3, pp=1, pp_schedule="1f1b",
                                   pp_virtual_stages=1, pp_layers_per_stage=None)
    t = cfg.train
    train = dataclasses.replace(
        t, steps=min(t.steps, 20), micro_batch_size=min(t.micro_batch_size, 4),
        grad_accum=1, warmup_steps=min(t.warmup_steps, 2), dtype="float32",
        activation_checkpointing="none",
        eval_every=min(t.eval_every, 10), eval_batches=min(t.eval_batches, 2),
        ckpt_every=min(t.ckpt_every, 10), lr=max(t.lr, 1e-3),
        min_lr=min(max(t.min_lr, 1e-4), max(t.lr, 1e-3)))
    return dataclasses.replace(cfg, model=model, moe=moe, parallel=parallel, train=train,
                               name=cfg.name if cfg.name.endswith("-tiny") else f"{cfg.name}-tiny",
                               scale="full")


def apply_scale(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """``scale=tiny``: shrink, then apply the command line's other overrides on top, so
    ``scale=tiny parallel.ep=2 train.steps=5`` keeps the ep and steps asked for."""
    tiny = shrink(cfg)
    # Renamed keys were migrated (with their warning) when the config was first loaded.
    rest = [renamed_override(o) for o in overrides if parse_override(o)[0] != ["scale"]]
    if not rest:
        return tiny
    data = apply_overrides(to_dict(tiny), rest)
    keys = [parse_override(o)[0] for o in rest]
    if ["model", "dim"] in keys and ["moe", "dim"] not in keys:
        data["moe"]["dim"] = data["model"].get("dim", ModelConfig.dim)
    return from_dict(RunConfig, data)
