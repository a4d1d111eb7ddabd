"""``epscale generate RUN_DIR --prompt TEXT``: continue a prompt with the newest checkpoint
of a run (greedy by default; ``--temperature`` / ``--top-p`` / ``--seed`` sample), with a
KV cache and the run's tokenizer (:mod:`epscale.interop.generate`)."""

from __future__ import annotations

import sys

from ..config import ConfigError
from ..interop.generate import generate, load_model, load_tokenizer, stop_ids_of


def configure_parser(p) -> None:
    p.add_argument("run_dir", help="a run directory (its newest complete checkpoint) or a "
                   "checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; else sample from softmax(logits / T)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample only from the smallest set of tokens holding this probability")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    p.add_argument("--no-stop", action="store_true",
                   help="do not stop at the imported model's end-of-sequence token")


def run(args) -> int:
    model, cfg, path = load_model(args.run_dir)
    tok = load_tokenizer(args.run_dir, cfg)
    run_dir = path.parent.parent
    stop = set() if args.no_stop else stop_ids_of(run_dir, tok)
    prompt = tok.encode(args.prompt)
    try:
        out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_p,
                       args.seed, stop)
    except ValueError as e:  # a prompt too long for model.seq_len, a bad temperature
        raise ConfigError(str(e)) from None
    stopped = bool(out) and out[-1] in stop
    # decoded whole (the tokenizer places the spaces), without the end-of-text token
    print(tok.decode(prompt + (out[:-1] if stopped else out)))
    if stopped:
        note = ("the first new token was end-of-text, so only the prompt is printed"
                if len(out) == 1 else f"stopped at end-of-text after {len(out) - 1} new tokens")
        print(f"({note}; --no-stop continues past it)", file=sys.stderr)
    return 0
