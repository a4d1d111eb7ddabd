"""Text generation from a run's newest checkpoint: greedy or sampled (temperature, top-p)
decoding with a KV cache (:class:`epscale.model.KVCache`), and the run's tokenizer
(``data.tokenizer``; else a ``tokenizer.json`` in the run directory or in ``hf_source/``
of an import; else raw bytes).

Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import RunConfig
from ..model import KVCache, Transformer
from ..training import checkpoint as ckpt
from ..training.data import tokenizer as data_tokenizer
from .files import HFError
from .hf import SOURCE_DIR, load_tensors, model_from_state, model_shapes, run_config


class TextCodec:
    """Text <-> ids through a tokenizer of :mod:`epscale.training.data.tokenizer` (which
    encodes only): ``bytes`` decodes ids 0-255 as UTF-8, a tokenizer.json through the
    ``tokenizers`` library."""

    def __init__(self, tok: data_tokenizer.Tokenizer):
        self.tok, self.name = tok, tok.name
        self.eos_id = tok.eos_id

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode_batch([text])[0]]

    def decode(self, ids: list[int]) -> str:
        if isinstance(self.tok, data_tokenizer.ByteTokenizer):
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tok.tok.decode(ids)


def load_tokenizer(run_dir: str | Path, cfg: RunConfig) -> TextCodec:
    """The run's tokenizer: ``data.tokenizer`` when it names a tokenizer.json; else
    RUN_DIR/tokenizer.json, else RUN_DIR/hf_source/tokenizer.json (an import's); else
    bytes (when the vocabulary holds them)."""
    run_dir = Path(run_dir)
    spec = cfg.data.tokenizer
    if spec == "bytes":
        for path in (run_dir / "tokenizer.json", run_dir / SOURCE_DIR / "tokenizer.json"):
            if path.is_file():
                spec = str(path)
                break
    if spec == "bytes" and cfg.model.vocab_size < 256:
        raise HFError(f"run '{run_dir}' has no tokenizer.json and a vocabulary of "
                      f"{cfg.model.vocab_size} < 256, so its tokens are not bytes; set "
                      "data.tokenizer or put the tokenizer.json it was trained with in the run "
                      "directory")
    return TextCodec(data_tokenizer.load_tokenizer(spec, require_eos=False))


def load_model(source: str | Path) -> tuple[Transformer, RunConfig, Path]:
    """The model of the newest checkpoint of run directory ``source`` (or of a checkpoint
    directory), whole, in this process (fp32, eval mode), its recipe and the checkpoint."""
    path = ckpt.resolve(source)
    meta = ckpt.validate(path)
    cfg = run_config(path, meta)
    state = load_tensors(path, {n: None for n in model_shapes(cfg)})
    return model_from_state(cfg, state), cfg, path


def _next_token(logits_BV: torch.Tensor, temperature: float, top_p: float,
                gen: torch.Generator | None) -> torch.Tensor:
    """int64 [B]: the argmax (temperature 0), else a sample of softmax(logits / T)
    restricted to the smallest set of tokens whose probability reaches ``top_p``."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    probs = (logits_BV / temperature).softmax(dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked higher
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             stop_ids: set[int] | None = None, use_cache: bool = True) -> list[int]:
    """The ids that follow ``prompt_ids`` (at most ``max_new_tokens``; fewer when a stop
    id comes, which is kept). ``use_cache``: one forward over the prompt, then one per
    new token over the KV cache (False: each step runs the whole sequence again, the
    slow form the tests compare with). The prompt plus the new tokens must fit in
    ``model.seq_len``."""
    if not prompt_ids:
        raise ValueError("generate: the prompt encodes to no tokens")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"generate: temperature {temperature} must be >= 0 and top_p "
                         f"{top_p} in (0, 1]")
    V, limit = model.cfg.vocab_size, model.cfg.seq_len
    bad = [i for i in prompt_ids if not 0 <= i < V]
    if bad:
        raise ValueError(f"generate: prompt token id {bad[0]} is outside the vocabulary [0, {V})")
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(f"generate: {len(prompt_ids)} prompt tokens + {max_new_tokens} new "
                         f"ones exceed model.seq_len = {limit}")
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    seq = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    cache = KVCache(len(model.layers)) if use_cache else None
    logits_BSV = model(seq, cache=cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt_B = _next_token(logits_BSV[:, -1].float(), temperature, top_p, gen)
        out.append(int(nxt_B[0]))
        if (stop_ids and out[-1] in stop_ids) or len(out) == max_new_tokens:
            break
        if cache is not None:
            logits_BSV = model(nxt_B.view(1, 1), cache=cache)
        else:
            seq = torch.cat((seq, nxt_B.view(1, 1)), dim=1)
            logits_BSV = model(seq)
    return out


def stop_ids_of(run_dir: str | Path, codec: TextCodec | None = None) -> set[int]:
    """End-of-sequence ids: an imported run's (its config.json's eos_token_id) and the
    tokenizer's EOS (a tokenizer.json's; 256 for bytes, which only a vocabulary of 258
    trained on prepared data emits: the id an export's generation_config.json names)."""
    out = set()
    if codec is not None and codec.eos_id is not None:
        out.add(int(codec.eos_id))
    f = Path(run_dir) / SOURCE_DIR / "config.json"
    if f.is_file():
        eos = json.loads(f.read_text()).get("eos_token_id")
        if eos is not None:
            out.update(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return out
