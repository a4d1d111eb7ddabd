"""``epscale monitor``: the run reader, the alert rules, --check, the report file, the live
view, and the end-to-end evidence (a trained run with a collapsed router fires the
imbalance and dead-expert alerts; a healthy one fires none)."""

from __future__ import annotations

import io
import json
import re
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from epscale.cli import main as cli_main
from epscale.monitor import AlertRules, evaluate, load_run
from epscale.monitor.live import Follower, follow, load_bar, render, sparkline
from epscale.monitor.report import build_data
from epscale.monitor.runlog import JsonlTail
from runfactory import make_run

REPO = Path(__file__).resolve().parents[1]
NOW = 1_700_000_000.0


def rules_of(alerts):
    return sorted(a.rule for a in alerts)


# ---------------------------------------------------------------------- alert rules


def test_healthy_run_fires_nothing(tmp_path):
    run = load_run(make_run(tmp_path / "ok"))
    assert run.warnings == [] and len(run.steps) == 60 and run.ended
    assert evaluate(run, now=NOW) == []


@pytest.mark.parametrize("scenario, rule, subject, since", [
    (dict(collapse_layer=1, collapse_from=5), "imbalance", "layer 1", 5),
    (dict(dead={0: [3, 5]}, dead_from=10), "dead_experts", "layer 0 experts 3,5", 10),
    (dict(straggler_rank=3, straggler_from=30, ep=4), "straggler", "rank 3 (node00)", 30),
    (dict(nan_at=(33, 41)), "nonfinite", "run", 33),
    (dict(spike_at=(45,)), "loss_spike", "run", 45),
    (dict(slow_from=50), "throughput", "run", 50),
    (dict(comm_share=0.7), "comm_share", "run", 1),
    (dict(bias_growth=0.05), "bias_saturation", "layer 0", 20),
    (dict(silent_rank=1), "silent_rank", "rank 1 (node00)", 30),
])
def test_each_pathology_fires_its_rule(tmp_path, scenario, rule, subject, since):
    run = load_run(make_run(tmp_path / rule, **scenario))
    alerts = [a for a in evaluate(run, now=NOW) if a.rule != "dead_experts" or rule == "dead_experts"]
    assert [a.rule for a in alerts] == [rule], [a.line() for a in alerts]
    a = alerts[0]
    assert a.subject == subject and a.since_step == since
    assert a.line().startswith(f"ALERT {rule}: {subject} since step {since}: ")


def test_collapse_names_layer_expert_and_both_rules(tmp_path):
    run = load_run(make_run(tmp_path / "c", collapse_layer=0, experts=8))
    alerts = evaluate(run, now=NOW)
    assert rules_of(alerts) == ["dead_experts", "imbalance"]
    imb = next(a for a in alerts if a.rule == "imbalance")
    assert imb.layer == 0 and "MaxVio 7.00" in imb.message and "hottest expert 0" in imb.message
    dead = next(a for a in alerts if a.rule == "dead_experts")
    assert dead.expert == [1, 2, 3, 4, 5, 6, 7] and dead.since_step == 1


def test_thresholds_are_configurable_and_validated(tmp_path):
    run = load_run(make_run(tmp_path / "c", collapse_layer=0))
    loose = AlertRules.load(None, ["imbalance_max_vio=10", "dead_expert_steps=100"])
    assert evaluate(run, loose, now=NOW) == []
    drops = load_run(make_run(tmp_path / "d", drop_frac=0.03))
    assert evaluate(drops, now=NOW) == []
    assert rules_of(evaluate(drops, AlertRules(max_drop_frac=0.02), now=NOW)) == ["drop_rate"] * 2
    with pytest.raises(Exception, match="alert rule 'imbalance_steps' = 0 is invalid: must be a positive integer"):
        AlertRules.load(None, ["imbalance_steps=0"])
    with pytest.raises(Exception, match="unknown config key 'alerts.imbalance'.*imbalance_steps"):
        AlertRules.load(None, ["imbalance=3"])
    with pytest.raises(Exception, match="throughput_drop"):
        AlertRules(throughput_drop=1.5)


def test_silent_rank_needs_a_running_job(tmp_path):
    run = load_run(make_run(tmp_path / "s", silent_rank=0))
    assert rules_of(evaluate(run, now=NOW)) == ["silent_rank"]
    # the same heartbeats judged right after they were written: all fresh
    assert evaluate(run, now=NOW - 3500) == []
    (tmp_path / "s" / "heartbeats" / "rank1.json").unlink()
    found = evaluate(load_run(tmp_path / "s"), now=NOW)
    assert sorted(a.subject for a in found) == ["rank 0 (node00)", "rank 1"]


# ---------------------------------------------------------------------- reading


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    run = load_run(make_run(tmp_path / "t", truncate_last=True, steps=30))
    assert len(run.steps) == 29
    assert run.warnings == ["metrics.jsonl line 32 is truncated (the run stopped mid-write?); skipped"]


def test_garbage_lines_rollback_and_merged_lines(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    lines = [{"event": "start", "step": 0, "time": 1.0}]
    lines += [{"step": s, "loss": 3.0, "time": 1.0 + s} for s in range(1, 11)]
    lines += [{"event": "rollback", "step": 10, "to_step": 6, "time": 20.0}]
    lines += [{"step": s, "loss": 2.0, "time": 20.0 + s} for s in range(7, 13)]
    text = "\n".join(json.dumps(x) for x in lines)
    text += '\nnot json at all\n{"step": 12, "val_loss": 2.5}\n["a list"]\n{"no_step": 1}\n'
    (d / "metrics.jsonl").write_text(text)
    run = load_run(d)
    assert [r["step"] for r in run.steps] == list(range(1, 13))
    assert [r["loss"] for r in run.steps] == [3.0] * 6 + [2.0] * 6  # 7.. from the kept timeline
    assert run.steps[-1]["val_loss"] == 2.5 and run.steps[-1]["loss"] == 2.0
    assert len(run.warnings) == 3 and "line 19 is not a JSON object" in run.warnings[0]
    assert not run.ended and run.config is None and run.world_size is None
    assert rules_of(evaluate(run, now=NOW)) == ["nonfinite"]  # the rollback event


def test_tail_keeps_a_partial_line_until_it_is_complete(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": ')
    tail = JsonlTail(p)
    objs, warns = tail.read()
    assert objs == [{"step": 1}] and warns == []
    with open(p, "a") as f:
        f.write('2}\n')
    assert tail.read() == ([{"step": 2}], [])
    assert tail.read() == ([], [])


def test_minimal_records_are_enough(tmp_path):
    run = load_run(make_run(tmp_path / "m", minimal=True, collapse_layer=0))
    assert rules_of(evaluate(run, now=NOW)) == ["dead_experts", "imbalance"]
    data = build_data(run, [], AlertRules())
    assert set(data["scalars"]) == {"loss", "lr", "tokens_per_s"} and data["breakdown"] == {}
    assert data["layers"][0]["max_vio"][-1] == pytest.approx(7.0)
    assert data["ranks"]["num_ep"] == 2  # rank loads derived from config.yaml's ep


def test_report_data_is_bucketed_for_long_runs(tmp_path):
    run = load_run(make_run(tmp_path / "long", steps=1200, layers=1))
    data = build_data(run, [], AlertRules(), max_points=100)
    assert len(data["x"]) == 100 and data["x"][-1] == 1200
    assert len(data["layers"][0]["load"]) == 100 and len(data["layers"][0]["load"][0]) == 8
    assert len(data["scalars"]["loss"]) == 100
    assert [p[0] for p in data["val_loss"]] == list(range(20, 1201, 20))


# ---------------------------------------------------------------------- the command


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["monitor", *args])
    return code, out.getvalue(), err.getvalue()


def test_check_exit_codes_and_lines(tmp_path):
    ok = make_run(tmp_path / "ok")
    code, out, err = run_cli(str(ok), "--check")
    assert code == 0 and re.fullmatch(r"OK synthetic: no alerts \(15 rules, 60 records, last step 60\)\n", out)
    bad = make_run(tmp_path / "bad", collapse_layer=1, nan_at=(20,))
    code, out, err = run_cli(str(bad), "--check")
    lines = out.splitlines()
    assert code == 1 and len(lines) == 3 and all(x.startswith("ALERT ") for x in lines)
    assert not (bad / "report.html").exists()
    code, out, _ = run_cli(str(bad), "--check", "--rule", "imbalance_max_vio=100",
                           "--rule", "dead_expert_steps=1000", "--rule", "recent_records=10")
    assert code == 0, out
    (bad / "alerts.yaml").write_text("imbalance_max_vio: 100\ndead_expert_steps: 1000\n")
    code, out, _ = run_cli(str(bad), "--check")
    assert code == 1 and out.startswith("ALERT nonfinite") and len(out.splitlines()) == 1


def test_check_and_report_on_a_crashed_run(tmp_path):
    run = make_run(tmp_path / "crash", truncate_last=True)
    code, out, err = run_cli(str(run), "--check")
    assert "warning: metrics.jsonl line 63 is truncated" in err
    # no end event and heartbeats from long ago: the crashed job's ranks are silent
    assert code == 1 and [x.split(" since")[0] for x in out.splitlines()] == [
        "ALERT silent_rank: rank 0 (node00)", "ALERT silent_rank: rank 1 (node00)"]
    code, out, err = run_cli(str(run), "--out", str(tmp_path / "r" / "crash.html"))
    assert code == 0 and "wrote" in out and (tmp_path / "r" / "crash.html").is_file()
    assert "is truncated" in (tmp_path / "r" / "crash.html").read_text()


def test_usage_errors_exit_2(tmp_path):
    code, _out, err = run_cli(str(tmp_path / "nope"), "--check")
    assert code == 2 and "does not exist" in err
    make_run(tmp_path / "x")
    code, _out, err = run_cli(str(tmp_path / "x"), "--check", "--rule", "max_comm_share=7")
    assert code == 2 and "max_comm_share" in err and "(0, 1]" in err


def test_report_is_self_contained(tmp_path):
    run = make_run(tmp_path / "c", collapse_layer=1, straggler_rank=0, ep=4)
    code, out, _ = run_cli(str(run))
    html = (run / "report.html").read_text()
    assert code == 0 and "2 alerts" not in out
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html and "<script src" not in html
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", html))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls
    data = json.loads(re.search(r'<script type="application/json" id="epscale-data">(.*?)</script>',
                                html, re.S).group(1).replace("<\\/", "</"))
    assert [a["rule"] for a in data["alerts"]] == ["imbalance", "dead_experts", "straggler"]
    kinds = re.findall(r'data-plot="(\w+)"', html)
    for k in ("loss", "grad_norm", "throughput", "comm", "breakdown", "expert_load", "max_vio",
              "drop_rate", "rank_load", "rank_idle", "rank_time"):
        assert k in kinds
    assert kinds.count("expert_load") == 2
    for a in ("imbalance", "dead_experts", "straggler"):
        assert f'<tr class="alert"><td>{a}</td>' in html


# ---------------------------------------------------------------------- live view


def test_live_render_shows_layers_ranks_and_alerts(tmp_path):
    run = load_run(make_run(tmp_path / "c", collapse_layer=0, silent_rank=1))
    con = Console(record=True, width=160, file=io.StringIO())
    con.print(render(run, evaluate(run, now=NOW), now=NOW))
    text = con.export_text()
    assert "MoE layers" in text and "ALERT imbalance: layer 0" in text
    assert "ALERT silent_rank: rank 1 (node00)" in text and "3,600s ago (step 30)" in text
    assert "7.00" in text  # layer 0 MaxVio
    big = load_run(make_run(tmp_path / "big", layers=20, ep=32, experts=64, steps=3,
                            straggler_rank=17))
    con = Console(record=True, width=200, file=io.StringIO())
    con.print(render(big, [], now=NOW, max_rows=5))
    text = con.export_text()
    assert "the 5 of 20 with the highest MaxVio" in text and "the 5 slowest of 32" in text
    assert re.search(r"^│\s+17\s", text, re.M)  # the straggler is among the shown ranks
    assert sparkline([1, 2, 3, None, float("nan"), 4]) == "▁▃▆█"
    bar = load_bar([0, 10, 30]).plain
    assert bar[0] == "·" and bar[2] == "█"


def test_follow_tails_a_growing_run_until_it_ends(tmp_path):
    src = make_run(tmp_path / "src", steps=12)
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    dst = tmp_path / "live"
    (dst / "heartbeats").mkdir(parents=True)
    (dst / "config.yaml").write_text((src / "config.yaml").read_text())

    def writer():
        with open(dst / "metrics.jsonl", "w") as f:
            for i, line in enumerate(lines):
                if i == 5:  # a line written in two pieces
                    f.write(line[:10])
                    f.flush()
                    time.sleep(0.1)
                    line = line[10:]
                f.write(line)
                f.flush()
                time.sleep(0.02)

    t = threading.Thread(target=writer)
    con = Console(record=True, width=140, file=io.StringIO(), force_terminal=False)
    t.start()
    code = follow(dst, AlertRules(), interval=0.05, exit_on_end=True, console=con, max_seconds=60)
    t.join()
    assert code == 0
    fol = Follower(dst)
    fol.poll()
    assert len(fol.run.steps) == 12 and fol.run.ended and fol.run.warnings == []
    assert "step 12" in con.export_text()


# ---------------------------------------------------------------------- evidence: a real run


TINY = ["model.dim=64", "moe.hidden_dim=128", "model.dense_hidden_dim=256", "model.seq_len=64",
        "model.num_layers=2", "train.eval_every=0", "train.ckpt_every=0", "train.micro_batch_size=4"]


def _train(run_dir: Path, *overrides: str) -> int:
    """``epscale train`` of the tiny recipe, one process, in this one (a process of its own
    would spend seconds importing torch); its exit status."""
    import contextlib

    with contextlib.redirect_stdout(io.StringIO()):
        return cli_main(["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--nproc", "1",
                         "--run-dir", str(run_dir), "parallel.ep=1", *TINY, *overrides])


def test_trained_run_with_collapsed_router_fires_imbalance_and_dead_experts(tmp_path):
    """The tiny recipe (shrunk to 2 layers of width 64, one process) trained on text that
    is one repeated byte: every token reaches the router with the same hidden state, so
    top-1 routing sends all of them to one expert (balance loss and bias update off). A real
    collapse, through the real trainer and its metrics.jsonl, caught by the default
    rules. The same recipe on ordinary text (Python source) must fire no alert."""
    steps = "train.steps=22"
    one_byte = tmp_path / "aaaa.txt"
    one_byte.write_text("a" * 60_000)
    collapsed = tmp_path / "collapsed"
    assert _train(collapsed, steps, "moe.top_k=1", "moe.aux_loss_coeff=0",
                  "moe.bias_update_speed=0", f"data.source={one_byte}") == 0
    code, out, err = run_cli(str(collapsed), "--check")
    assert code == 1, out + err
    fired = {line.split(":")[0] for line in out.splitlines()}
    assert fired == {"ALERT imbalance", "ALERT dead_experts"}, out
    assert re.search(r"ALERT imbalance: layer \d since step 1: MaxVio 7\.00", out)
    # how many experts stay dead from step 1 on depends on the initial weights (4-5 with the
    # layout-independent init of issue #19, 6-7 with torch's default init before it)
    assert re.search(r"ALERT dead_experts: layer \d experts [\d,]+ since step 1: [4-7] of 8 experts",
                     out)

    import argparse
    import textwrap

    text = tmp_path / "python.txt"  # ordinary text: Python source of two stdlib modules
    text.write_text(Path(argparse.__file__).read_text() + Path(textwrap.__file__).read_text())
    healthy = tmp_path / "healthy"
    assert _train(healthy, steps, f"data.source={text}") == 0
    code, out, err = run_cli(str(healthy), "--check")
    assert code == 0 and out.startswith("OK "), out + err
    code, out, err = run_cli(str(collapsed))
    assert code == 0 and (collapsed / "report.html").stat().st_size > 10_000
