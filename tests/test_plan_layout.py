"""The one Layout (``epscale.plan.layout``): its degrees and rules without a process group,
one message per broken layout from every command that checks one (train's pre-launch
check, describe, slurm render, the elastic world check), and the one label every layout
gets (the report and ``checkpoint list`` included). No processes are started."""

from __future__ import annotations

import contextlib
import io

import pytest

from epscale.cli import main as cli_main
from epscale.config import ConfigError, load_recipe
from epscale.monitor.alerts import AlertRules
from epscale.monitor.report import build_data, render_html
from epscale.monitor.runlog import RunLog
from epscale.plan.layout import Layout, record_label
from epscale.training.elastic import why_not

NO_PIPE = ["model.tie_embeddings=false"]
# (what is broken, overrides of the tiny recipe, world, a piece of the one message)
BROKEN = [
    ("ep does not divide the experts", ["parallel.ep=3"], 3,
     "'parallel.ep' = 3 is invalid: must divide moe.num_experts (8)"),
    ("ep does not divide the world", ["parallel.ep=2"], 3,
     "'parallel.ep' = 2 is invalid: must divide the 3 processes"),
    ("ep does not divide dp_shard", ["parallel.fsdp=true", "parallel.ep=4"], 6,
     "'parallel.ep' = 4 is invalid: must divide dp_shard = 6"),
    ("dp_replicate x dp_shard is not the world", ["parallel.fsdp=true", "parallel.ep=1",
                                                 "parallel.dp_replicate=3"], 4,
     "'parallel.dp_replicate' = 3 is invalid: must divide the 4 processes"),
    ("dp_replicate x dp_shard is not a stage", NO_PIPE + [
        "parallel.fsdp=true", "parallel.ep=1", "parallel.dp_replicate=3", "parallel.pp=2",
        "train.grad_accum=4"], 4,
     "'parallel.dp_replicate' = 3 is invalid: must divide the 2 ranks of one pipeline stage"),
    ("pp does not divide the world", NO_PIPE + ["parallel.pp=2", "parallel.ep=1",
                                                "train.grad_accum=4"], 3,
     "'parallel.pp' = 2 is invalid: must divide the number of processes (3)"),
    ("fewer layers than stages", NO_PIPE + ["parallel.pp=8", "parallel.ep=1",
                                            "train.grad_accum=8"], 8,
     "'parallel.pp' = 8 is invalid: 8 ranks x 1 stage(s) per rank"),
    ("too few micro-batches for 1F1B", NO_PIPE + ["parallel.pp=2", "parallel.ep=1",
                                                  "train.grad_accum=1"], 2,
     "'train.grad_accum' = 1 is invalid: gives 1 micro-batches per step"),
    ("a global batch the schedule cannot run", NO_PIPE + [
        "parallel.pp=2", "parallel.ep=1", "parallel.pp_schedule=dualpipev",
        "train.micro_batch_size=1", "train.global_batch_size=6"], 4,
     "'train.global_batch_size' = 6 is invalid: gives 3 micro-batches per step"),
    ("a global batch that does not split", ["train.micro_batch_size=1",
                                            "train.global_batch_size=6"], 4,
     "'train.global_batch_size' = 6 is invalid: cannot be kept at 4 processes"),
    ("redundant slots that do not divide over ep", ["parallel.redundant_experts=3"], 2,
     "'parallel.redundant_experts' = 3 is invalid: moe.num_experts + redundant_experts = 11"),
]


def _cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli_main(list(argv))
    return code, err.getvalue()


def _elastic(overrides: list[str], world: int) -> str:
    """What the elastic world check says (a restart's config loads first)."""
    try:
        cfg = load_recipe("tiny", overrides)
    except ConfigError as e:
        return str(e)
    return why_not(cfg, world)


@pytest.mark.parametrize("what,overrides,world,piece", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_layout_gets_one_message_everywhere(what, overrides, world, piece, tmp_path,
                                                     monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)   # train checks before it launches
    msg = _elastic(overrides, world)
    assert piece in msg, msg
    code, err = _cli("train", "--config", "tiny", "--nproc", str(world),
                     "--run-dir", str(tmp_path / "run"), *overrides)
    assert (code, err.strip()) == (2, f"epscale train: error: {msg}")
    assert not (tmp_path / "run").exists()
    code, err = _cli("describe", "tiny", "--world", str(world), *overrides)
    assert (code, err.strip()) == (2, f"epscale describe: error: {msg}")
    code, err = _cli("slurm", "render", "tiny", "--nodes", "1", "--gpus-per-node", "0",
                     "--procs-per-node", str(world), "-o", str(tmp_path / "job.sbatch"),
                     *overrides)
    assert code == 2 and f"{msg}" in err, err
    assert not (tmp_path / "job.sbatch").exists()


def test_degrees_and_coordinates_without_a_process_group():
    cfg = load_recipe("tiny", NO_PIPE + ["parallel.fsdp=true", "parallel.dp_replicate=2",
                                         "parallel.pp=2", "train.grad_accum=2"])
    lay = Layout.from_config(cfg, 16, ranks_per_node=4)
    assert (lay.stage_size, lay.dp, lay.dp_shard, lay.efsdp) == (8, 4, 4, 2)
    assert (lay.num_nodes, lay.ep_ranks_per_node, lay.ep_num_nodes) == (4, 2, 1)
    assert lay.note == "parallel.dp_shard = 4 (the world over dp_replicate = 2)"
    assert lay.coords(13) == dict(pp_rank=1, stage_rank=5, dp_rank=2, ep_rank=1,
                                  replica_rank=1, efsdp_rank=0, node_rank=3)
    assert lay.global_batch == 8 * 2 * cfg.train.micro_batch_size
    # the replicated layout derives dp from the world, and says so
    rep = Layout.from_config(load_recipe("tiny"), 6)
    assert (rep.dp, rep.ep, rep.note) == (3, 2, "parallel.dp=1 x parallel.ep=2 != 6 processes: "
                                                 "using dp=3")
    with pytest.raises(ConfigError, match="'parallel.ranks_per_node' = 12 is invalid: does not "
                                          "fit ep = 8: an EP group must fill whole nodes"):
        Layout(24, ep=8, ranks_per_node=12)
    with pytest.raises(ConfigError, match=r"pp x dp x ep = 1 x 2 x 2 = 4 must equal .* \(6\)"):
        Layout.from_degrees(6, dp=2, ep=2)


LABELS = [
    (dict(world=4, ep=2), "dp=2 x ep=2"),
    (dict(world=4, ep=2, fsdp=True), "FSDP dp_shard=4 (ep=2, efsdp=2)"),
    (dict(world=8, ep=2, fsdp=True, dp_replicate=2), "HSDP dp_replicate=2 x dp_shard=4 (ep=2, efsdp=2)"),
    (dict(world=4, ep=2, pp=2, micro_batches=2), "pp=2 x (dp=1 x ep=2)"),
    (dict(world=8, ep=2, pp=2, fsdp=True, micro_batches=2), "pp=2 x (FSDP dp_shard=4 (ep=2, efsdp=2))"),
]


@pytest.mark.parametrize("degrees,label", LABELS, ids=[x[1] for x in LABELS])
def test_every_layout_is_labelled_by_what_it_is(degrees, label):
    lay = Layout(**degrees)
    assert lay.label() == label
    # a start event or a checkpoint's meta.json (FSDP from the run's config) reads the same
    rec = {"world_size": lay.world, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep}
    par = {"fsdp": lay.fsdp, "dp_replicate": lay.dp_replicate}
    assert record_label(rec, par) == label
    assert record_label({**rec, "fsdp": lay.fsdp, "dp_replicate": lay.dp_replicate}) == label
    assert record_label({"world_size": 4}) == "?"


def test_describe_labels_the_pipeline_with_its_schedule():
    lay = Layout(world=4, ep=2, pp=2, micro_batches=4, pp_schedule="dualpipev",
                 pp_virtual_stages=2)
    assert lay.label(pipeline=True) == ("pp=2 (dualpipev, 2 stages per rank, 4 micro-batches) "
                                        "x (dp=1 x ep=2)")


@pytest.mark.parametrize("start,par,label", [
    ({"world_size": 4, "pp": 2, "dp": 1, "ep": 2, "fsdp": False}, {"dp": 1, "ep": 2, "pp": 2},
     "pp=2 x (dp=1 x ep=2)"),
    ({"world_size": 2, "pp": 1, "dp": 1, "ep": 2, "fsdp": True, "dp_replicate": 1},
     {"dp": 1, "ep": 2, "fsdp": True}, "FSDP dp_shard=2 (ep=2, efsdp=1)"),
])
def test_the_report_labels_a_pipeline_and_an_fsdp_run(tmp_path, start, par, label):
    """Issue 34 found both labelled 'dp=1 x ep=2' (read from the config's parallel.dp)."""
    run = RunLog(tmp_path, steps=[{"step": 1, "loss": 5.0}],
                 events=[{"event": "start", "step": 0, **start}],
                 config={"name": "r", "moe": {"num_experts": 8}, "parallel": par})
    html = render_html(run, build_data(run, [], AlertRules()), [], now=0.0)
    assert f"{label}, dispatcher" in html
    assert "dp=1 × ep=2" not in html
