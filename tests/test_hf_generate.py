"""Generation with a KV cache (the cached forward itself: tests/test_model.py): greedy
decoding with the cache equals decoding without it and equals transformers' greedy
``generate`` on an imported model; ``epscale generate`` uses the run's tokenizer.json;
sampling is seeded and top-p narrows it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_hf_models import CASES, V, randomize
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from epscale.cli import main
from epscale.config import load_config
from epscale.interop.generate import generate, load_model, load_tokenizer
from epscale.interop.hf import from_pretrained, import_hf


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for name in ("mixtral", "qwen3_moe-yarn", "deepseek_v3-yarn"):
        cls, cfg = CASES[name]()
        torch.manual_seed(0)
        ref = randomize(cls(cfg).eval(), seed=3)
        ref.save_pretrained(root / name)
        out[name] = (root / name, ref)
    return out


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe-yarn", "deepseek_v3-yarn"])
def test_greedy_matches_transformers_generate(name, hf_models):
    hf_dir, ref = hf_models[name]
    model, _ = from_pretrained(hf_dir)
    prompt = [5, 17, 42, 3, 77]
    cached = generate(model, prompt, 24)
    assert cached == generate(model, prompt, 24, use_cache=False)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert cached == theirs
    assert len(set(cached)) > 2  # not a degenerate repeat of one token


def test_sampling_is_seeded_and_top_p_narrows_it(hf_models):
    model, _ = from_pretrained(hf_models["mixtral"][0])
    prompt = [1, 2, 3]
    a = generate(model, prompt, 16, temperature=1.5, seed=7)
    assert a == generate(model, prompt, 16, temperature=1.5, seed=7, use_cache=False)
    assert a != generate(model, prompt, 16, temperature=1.5, seed=8)
    assert a != generate(model, prompt, 16)  # sampling at T=1.5 leaves the greedy path
    # top-p this small keeps only the most likely token: greedy again
    assert generate(model, prompt, 16, temperature=1.5, top_p=1e-6, seed=7) == \
        generate(model, prompt, 16)
    assert generate(model, prompt, 16, stop_ids={a[3]}, temperature=1.5, seed=7) == a[:4]


def test_generate_command_uses_the_run_tokenizer(hf_models, tmp_path, capsys):
    hf_dir, _ = hf_models["mixtral"]
    words = [f"w{i}" for i in range(V)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(hf_dir / "tokenizer.json"))
    run = tmp_path / "run"
    import_hf(hf_dir, run, report=lambda m: None)
    model, _, _ = load_model(run)
    want = generate(model, [5, 17, 42], 6)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "w5 w17 w42", "--max-new-tokens", "6",
                 "--no-stop"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == " ".join(words[i] for i in [5, 17, 42] + want)
    assert main(["generate", str(run), "--prompt", "w1 " * 60, "--max-new-tokens", "8"]) == 2
    assert "exceed model.seq_len = 64" in capsys.readouterr().err


def test_a_byte_run_generates_text(tmp_path):
    cfg = load_config(None, ["model.vocab_size=256"])
    codec = load_tokenizer(tmp_path, cfg)
    assert codec.decode(codec.encode("héllo, wörld")) == "héllo, wörld"
    with pytest.raises(Exception, match="no tokenizer.json and a vocabulary of 100 < 256"):
        load_tokenizer(tmp_path, load_config(None, ["model.vocab_size=100"]))


def test_generate_says_when_it_stopped_at_end_of_text(hf_models, tmp_path, capsys):
    """The model's first new token is its end-of-text id: only the prompt is printed, and
    a note on stderr says why (--no-stop goes on)."""
    import json
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(hf_models["mixtral"][0], src)
    words = [f"w{i}" for i in range(V)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(src / "tokenizer.json"))
    model, _ = from_pretrained(src)
    first = generate(model, [5, 17, 42], 1)[0]
    hf_cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf_cfg, "eos_token_id": first}))
    run = tmp_path / "run"
    import_hf(src, run, report=lambda m: None)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "w5 w17 w42", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "w5 w17 w42"
    assert "the first new token was end-of-text, so only the prompt is printed" in err
    assert main(["generate", str(run), "--prompt", "w5 w17 w42", "--max-new-tokens", "4",
                 "--no-stop"]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 7 and "end-of-text" not in err
