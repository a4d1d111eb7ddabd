"""What epscale trains, transformers loads as the same model: for each recipe family, a
few steps with the recipe's own balancing (loss-free bias included), then export-hf ->
AutoModelForCausalLM / AutoTokenizer from the folder alone -> the same logits (fp32 within
1e-4, and float64) and the same greedy text as ``epscale generate``. A model no family
can hold is refused (exit 2) and written with --lossy, with a warning naming what is
dropped; the export folder is only ever one epscale wrote (issue 30 #5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer

from epscale.cli import main
from epscale.config import load_config, load_recipe
from epscale.interop.files import HFError
from epscale.interop.generate import generate, load_model, load_tokenizer, stop_ids_of
from epscale.interop.hf_families import choose
from epscale.training.data.prepare import prepare
from epscale.training.data.tokenizer import train_bpe
from epscale.training.loop import train

REPO = Path(__file__).resolve().parents[1]
SMALL = ["parallel.ep=1", "parallel.dp=1", "model.dim=32", "moe.dim=32", "model.num_heads=4",
         "model.seq_len=48", "model.dense_hidden_dim=48", "moe.hidden_dim=16",
         "train.steps=3", "train.micro_batch_size=2", "train.warmup_steps=1",
         "train.eval_every=3", "train.eval_batches=1", "train.ckpt_every=3", "train.log_every=1",
         "train.activation_checkpointing=none", "train.preflight=false"]
# name -> (recipe, extra overrides, the family export-hf must pick)
CASES = {
    "tiny": ("tiny", ["moe.bias_update_speed=0.05"], "ernie4_5_moe"),
    "deepseek-v3": ("deepseek-v3", ["moe.bias_update_speed=0.05", "moe.num_experts=16",
                                    "model.kv_lora_rank=16", "model.q_lora_rank=16",
                                    "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
                                    "model.v_head_dim=8"], "deepseek_v3"),
    "sigmoid-mha": ("deepseek-v3", ["model.attention=mha", "model.qk_norm=true",
                                    "model.mtp_depth=0",   # (glm4_moe stores no MTP module)
                                    "train.recompute_modules=[norm,moe_act]",
                                    "moe.bias_update_speed=0.05", "moe.num_experts=16"],
                    "glm4_moe"),
    "mixtral": ("mixtral-8x7b", ["model.num_kv_heads=2", "model.head_dim=8"], "mixtral"),
    "qwen3-qk-norm": ("qwen3-30b-a3b", ["model.qk_norm=true", "moe.num_experts=16",
                                        "model.num_kv_heads=2", "model.head_dim=8"],
                      "qwen3_moe"),
}


def _cfg(recipe: str, extra: list[str], tmp: Path, data: list[str]):
    over = ["scale=tiny", *SMALL, *data, *extra]
    if recipe == "tiny":  # the default recipe of the repository, configs/tiny.yaml
        return load_config(REPO / "configs" / "tiny.yaml", over[1:])
    return load_recipe(recipe, over)


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A byte-level BPE trained on real Python text and the text prepared with it: the
    run has a tokenizer of its own (EOS 0, BOS 1)."""
    root = tmp_path_factory.mktemp("bpe")
    import argparse as a
    import textwrap

    docs = [Path(m.__file__).read_text() for m in (a, textwrap)]
    text = root / "text"
    text.mkdir()
    for i, d in enumerate(docs):
        (text / f"{i}.txt").write_text(d)
    tok = train_bpe(iter(docs), 320, root / "tok")
    prepare([text], root / "tok", root / "prepared", workers=1, val_fraction=0.3,
            progress=False)
    return root / "tok", root / "prepared", tok


@pytest.fixture(scope="module")
def runs(tmp_path_factory, bpe_data):
    """Each case trained 3 steps (the tiny recipe on the BPE data, the others on bytes)."""
    root = tmp_path_factory.mktemp("runs")
    tok_dir, prepared, _ = bpe_data
    corpus = root / "corpus.txt"
    import string

    corpus.write_text(Path(string.__file__).read_text() * 4)
    out = {}
    for name, (recipe, extra, _) in CASES.items():
        data = ([f"data.source={prepared}", f"data.tokenizer={tok_dir}", "model.vocab_size=320"]
                if name == "tiny" else [f"data.source={corpus}", "model.vocab_size=256"])
        cfg = _cfg(recipe, extra, root, data)
        train(cfg, root / name)
        out[name] = root / name
    return out


def _prompt(tok, codec) -> list[int]:
    ids = codec.encode("def main(argv):\n    parser = ")
    assert tok("def main(argv):\n    parser = ")["input_ids"] == ids  # same tokenizer
    return ids


@pytest.mark.parametrize("name", list(CASES))
def test_trained_recipe_exports_exactly(name, runs, tmp_path, capsys):
    run = runs[name]
    out = tmp_path / "hf"
    assert main(["checkpoint", "export-hf", str(run), str(out)]) == 0
    printed = capsys.readouterr().out
    family = CASES[name][2]
    assert f"as {family} (exact)" in printed and "warning" not in printed
    ours, cfg, _ = load_model(run)
    biases = [b.ffn.router.expert_bias for b in ours.layers.values() if hasattr(b.ffn, "router")]
    if cfg.moe.bias_update_speed > 0:  # the recipe's loss-free balancing moved the bias
        assert any(b.abs().max() > 0 for b in biases)
    hf = AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    assert hf.config.model_type == family
    tok = AutoTokenizer.from_pretrained(out)  # the folder alone
    codec = load_tokenizer(run, cfg)
    ids = _prompt(tok, codec)
    toks = torch.tensor([ids, list(reversed(ids))])
    with torch.no_grad():
        torch.testing.assert_close(hf(toks).logits, ours(toks), rtol=1e-4, atol=1e-4)
        # the same function: equal in float64 up to the fp32 islands both keep (routers)
        got64, want64 = hf.double()(toks).logits, ours.double()(toks).double()
    torch.testing.assert_close(got64, want64, rtol=1e-5, atol=1e-5)
    hf.float()
    ours.float()
    # greedy text: transformers' generate (stopping at the folder's eos) == epscale's
    stops = stop_ids_of(run, codec)
    new = generate(ours, ids, 12, stop_ids=stops)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert theirs[0, len(ids):].tolist() == new
    assert tok.decode(new) == codec.decode(new)
    gen = json.loads((out / "generation_config.json").read_text())
    if name == "tiny":
        assert (tok.eos_token_id, gen["eos_token_id"], hf.config.eos_token_id) == (0, 0, 0)
        assert (tok.bos_token_id, gen["bos_token_id"]) == (1, 1)
        assert tok.pad_token_id == gen["pad_token_id"] == 0
    else:  # bytes, vocabulary 256: no end-of-text id at all
        assert tok.decode(codec.encode("héllo")) == "héllo"
        assert gen["eos_token_id"] is None and hf.config.eos_token_id is None


def test_a_model_no_family_holds_is_refused_then_lossy(runs, bpe_data, tmp_path, capsys):
    """Softmax routing with a trained bias and QK-norm: no transformers family has it.
    Refused with exit 2 and the reasons; --lossy writes qwen3_moe and names the bias;
    GELU experts are refused even with --lossy."""
    tok_dir, prepared, _ = bpe_data
    cfg = _cfg("tiny", ["moe.bias_update_speed=0.05", "model.qk_norm=true"], tmp_path,
               [f"data.source={prepared}", f"data.tokenizer={tok_dir}", "model.vocab_size=320"])
    run = tmp_path / "run"
    train(cfg, run)
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["checkpoint", "export-hf", str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert "no transformers family represents this model exactly" in err
    assert "ernie4_5_moe: model.qk_norm = true" in err and "--lossy" in err
    assert not out.exists()
    assert main(["checkpoint", "export-hf", str(run), str(out), "--arch", "ernie4_5_moe"]) == 2
    assert "cannot be written exactly as ernie4_5_moe" in capsys.readouterr().err
    assert main(["checkpoint", "export-hf", str(run), str(out), "--lossy"]) == 0
    printed = capsys.readouterr().out
    assert "warning: --lossy: written as qwen3_moe without the router's expert bias" in printed
    assert "as qwen3_moe (lossy)" in printed
    record = json.loads((out / "epscale_export.json").read_text())
    assert record["family"] == "qwen3_moe" and "expert bias" in record["dropped"][0]
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen3_moe"
    glam = load_recipe("glam-64e", ["scale=tiny"])
    with pytest.raises(HFError, match="(?s)moe.activation = 'gelu'.*no family can hold it even "
                                      "with --lossy"):
        choose(glam, lossy=True)


def test_export_folder_must_be_empty_or_its_own(runs, tmp_path, capsys):
    """Issue 30 #5: a folder holding another model is refused (exit 2, naming the folder
    and what is in the way) and left untouched; --overwrite replaces its model files and
    leaves the rest; a folder epscale exported into takes a new export without asking,
    and files someone added there are neither removed nor listed as exported."""
    run = runs["mixtral"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    (other / "model.safetensors.index.json").write_text("{}")
    (other / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    capsys.readouterr()
    assert main(["checkpoint", "export-hf", str(run), str(other)]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "config.json" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert main(["checkpoint", "export-hf", str(run), str(other), "--overwrite"]) == 0
    printed = capsys.readouterr().out
    names = {p.name for p in other.iterdir()}
    assert "model-00001-of-00002.safetensors" not in names            # the old model's
    assert "model.safetensors.index.json" not in names
    assert (other / "notes.txt").read_text() == "mine" and "notes.txt" not in printed
    assert json.loads((other / "config.json").read_text())["model_type"] == "mixtral"
    # its own folder: again without --overwrite; a stranger's file stays, unlisted
    (other / "README.md").write_text("about")
    assert main(["checkpoint", "export-hf", str(run), str(other), "--max-shard-size",
                 "20KiB"]) == 0
    printed = capsys.readouterr().out
    assert "README.md" not in printed and (other / "README.md").read_text() == "about"
    assert not (other / "model.safetensors").exists()                # replaced by shards
    assert (other / "model.safetensors.index.json").is_file()
    listed = json.loads((other / "epscale_export.json").read_text())["files"]
    assert "README.md" not in listed and "notes.txt" not in listed
    AutoModelForCausalLM.from_pretrained(other)
    # a foreign weight file dropped into its own folder is in the way again
    (other / "model.safetensors").write_bytes(b"y")
    assert main(["checkpoint", "export-hf", str(run), str(other)]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert (other / "model.safetensors").read_bytes() == b"y"
    # a file where the folder should be
    (tmp_path / "f").write_text("x")
    assert main(["checkpoint", "export-hf", str(run), str(tmp_path / "f")]) == 2


def test_describe_and_each_recipe_name_the_family_it_exports_to():
    from epscale.commands.describe import describe
    from epscale.config.recipes import RECIPE_DIR

    for f in sorted(RECIPE_DIR.glob("*.yaml")):
        comment = " ".join(line for line in f.read_text().splitlines()
                           if line.startswith("# Hugging Face:") or "export-hf" in line)
        said = describe(str(f))["hf_export"]
        try:
            family = choose(load_recipe(str(f))).family
        except HFError:
            assert "refuses" in comment and said.startswith("none"), f.name
            continue
        assert f"writes it as {family}, exactly" in comment, f.name
        assert said == f"{family} ({transformers_arch(family)}), exact", f.name


def transformers_arch(family: str) -> str:
    from epscale.interop.hf_families import ARCHITECTURES

    return ARCHITECTURES[family]


def test_report_tiles_are_the_console_summary(runs, tmp_path):
    """The run report's header shows the numbers of the console's end-of-run summary
    (median tokens/s, final validation loss, the unigram baseline), not the last step's,
    and says 'dropless' instead of a capacity factor of None."""
    from epscale.monitor import AlertRules, evaluate, load_run
    from epscale.monitor.report import header_cards, write_report

    run = load_run(runs["mixtral"])
    end = [e for e in run.events if e.get("event") == "end"][-1]
    assert end["unigram_nats"] > 0 and end["final_val_loss"] is not None
    alerts = evaluate(run, AlertRules())
    html = write_report(run, alerts, AlertRules(), tmp_path / "r.html").read_text()
    cards = {k: v for k, v, _ in header_cards(run, {"val_loss": []}, alerts)}
    from epscale.monitor.runlog import fmt_value

    assert cards["tokens/s (median)"] == fmt_value(end["tokens_per_s"])
    assert cards["validation loss (final)"] == fmt_value(end["final_val_loss"])
    assert cards["unigram baseline"] == fmt_value(end["unigram_nats"])
    assert cards["train loss (mean of last steps)"] == fmt_value(end["final_train_loss"])
    for k, v in cards.items():
        assert f">{k}<" in html and f">{v}<" in html
    assert "dropless" in html and "capacity factor None" not in html


def test_start_up_names_the_tokenizer_in_use_and_the_validation_tokens(bpe_data, tmp_path,
                                                                       capsys):
    """The data: line names data.tokenizer (here a copy in another folder, same sha256),
    not only the path recorded at prepare time, and says how many validation tokens one
    evaluation reads."""
    import shutil

    tok_dir, prepared, _ = bpe_data
    copy = tmp_path / "copy"
    shutil.copytree(tok_dir, copy)
    cfg = _cfg("tiny", ["train.steps=1", "train.eval_batches=2"], tmp_path,
               [f"data.source={prepared}", f"data.tokenizer={copy}", "model.vocab_size=320"])
    capsys.readouterr()
    train(cfg, tmp_path / "run")
    out = "".join(capsys.readouterr().out.split())  # rich wraps long lines anywhere

    def said(text: str) -> bool:
        return "".join(text.split()) in out[out.index("data:"):]

    assert said(f"tokenizer {copy / 'tokenizer.json'} (data.tokenizer; prepared with "
                f"{tok_dir / 'tokenizer.json'}, the same sha256)")
    assert said(f"each evaluation reads {2 * 2 * 48:,} (train.eval_batches = 2 global batches)")
