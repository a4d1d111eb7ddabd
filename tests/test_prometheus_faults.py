"""Optional metrics sinks never stop a run (issue #24, finding 3): a busy Prometheus port, an
address this host does not have, or a TensorBoard directory that cannot be created is a
warning in ``writer.notes`` (the trainer's start-up header), and metrics.jsonl goes on. The
endpoint binds 127.0.0.1 unless told otherwise and says where it listens. Real sockets, a
real HTTP fetch, a real (tiny, in-process) training run."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest

from epscale.config import load_config
from epscale.metrics import MetricsWriter, PrometheusSink, TensorBoardSink
from epscale.training.loop import train

pytest.importorskip("prometheus_client", reason="prometheus_client is in the monitor extra")


@pytest.fixture
def busy_port():
    """A port held by a real listening socket on 127.0.0.1 (what another job's exporter,
    or a second run on the same node, looks like)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_busy_port_is_a_warning_and_the_run_goes_on(tmp_path, busy_port):
    w = MetricsWriter.open(tmp_path, prometheus_port=busy_port, run_name="r")
    assert not any(isinstance(s, PrometheusSink) for s in w.sinks)
    [note] = w.notes
    assert note.startswith(f"warning: metrics.prometheus_port {busy_port} on 127.0.0.1 is in use "
                           "(OSError: "), note
    assert "no Prometheus endpoint this run; pick another port" in note
    w.write({"step": 1, "loss": 2.0})
    w.event("end", step=1)
    w.close()
    assert [r.get("event", r.get("step")) for r in _lines(tmp_path)] == [1, "end"]


def test_free_port_binds_localhost_says_where_and_serves(tmp_path):
    w = MetricsWriter.open(tmp_path, prometheus_port=0, run_name="r1")  # 0: a free port
    [prom] = [s for s in w.sinks if isinstance(s, PrometheusSink)]
    assert prom._server.server_address[0] == "127.0.0.1"  # not every interface by default
    assert w.notes == [f"metrics: Prometheus endpoint at http://127.0.0.1:{prom.port}/metrics"]
    w.write({"step": 7, "loss": 1.5})
    url = re.search(r"http://\S+", w.notes[0]).group(0)  # the URL the header prints works
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    assert 'epscale_step{run="r1"} 7.0' in text and 'epscale_loss{run="r1"} 1.5' in text
    w.close()


def test_wildcard_bind_is_named_by_hostname(tmp_path):
    w = MetricsWriter.open(tmp_path, prometheus_port=0, prometheus_addr="0.0.0.0")
    [prom] = [s for s in w.sinks if isinstance(s, PrometheusSink)]
    host = socket.gethostname()
    assert w.notes == [f"metrics: Prometheus endpoint at http://{host}:{prom.port}/metrics "
                       "(all interfaces, 0.0.0.0)"]
    with urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics", timeout=10) as r:
        assert r.status == 200
    w.close()


def test_address_not_on_this_host_is_a_warning(tmp_path):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine
    w = MetricsWriter.open(tmp_path, prometheus_port=0, prometheus_addr="192.0.2.1")
    assert [type(s).__name__ for s in w.sinks] == ["JsonlSink"]
    [note] = w.notes
    assert note.startswith("warning: metrics.prometheus_port 0 on 192.0.2.1 cannot be served"), note
    assert "check metrics.prometheus_addr" in note
    w.close()


def test_tensorboard_that_cannot_open_is_a_warning(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in the monitor extra")
    (tmp_path / "tensorboard").write_text("a file where the event directory should go")
    w = MetricsWriter.open(tmp_path, tensorboard=True)
    assert not any(isinstance(s, TensorBoardSink) for s in w.sinks)
    [note] = w.notes
    assert note.startswith(f"warning: metrics.tensorboard: cannot write {tmp_path / 'tensorboard'} "
                           "(FileExistsError"), note
    w.write({"step": 1, "loss": 2.0})
    w.close()
    ok = MetricsWriter.open(tmp_path / "ok", tensorboard=True)
    assert ok.notes == [f"metrics: TensorBoard events in {tmp_path / 'ok' / 'tensorboard'}"]
    ok.close()


def _corpus(tmp_path: Path) -> Path:
    import textwrap

    path = tmp_path / "corpus.txt"
    path.write_text(Path(textwrap.__file__).read_text() * 4)
    return path


def test_trainer_with_a_busy_port_trains_and_says_so(tmp_path, busy_port, capsys):
    over = {"model.dim": 32, "model.num_layers": 1, "model.num_heads": 2, "model.seq_len": 32,
            "model.dense_hidden_dim": 64, "moe.hidden_dim": 32, "moe.num_experts": 4,
            "moe.top_k": 2, "parallel.ep": 1, "parallel.dp": 1, "train.steps": 2,
            "train.micro_batch_size": 2, "train.warmup_steps": 1, "train.eval_every": 0,
            "train.ckpt_every": 0, "data.source": str(_corpus(tmp_path)), "name": "busy",
            "metrics.prometheus_port": busy_port}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    result = train(cfg, tmp_path / "run")
    assert result is not None and result.step == 2 and not result.stopped
    out = capsys.readouterr()
    text = out.out + out.err
    assert f"metrics.prometheus_port {busy_port} on 127.0.0.1 is in use" in text, text[-3000:]
    assert [r["event"] for r in _lines(tmp_path / "run") if "event" in r][-1] == "end"
