"""The HTML report in a real browser: Debian's headless Chromium opens the file offline,
every plot must report itself drawn, the page must record no error, and Chromium's own
console log must be clean. Chromium is installed here when missing and we are root
(CI runs as root in a fresh clone); the tests skip, saying why, only where it cannot be.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from epscale.monitor import AlertRules, evaluate, load_run
from epscale.monitor.report import write_report
from runfactory import make_run

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--virtual-time-budget=8000"]
NOW = 1_700_000_000.0


def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


@pytest.fixture(scope="session")
def chromium() -> str:
    path = _find_chromium()
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("headless Chromium is not installed and cannot be installed here "
                    "(needs root and apt-get): apt-get install chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log = []
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                              stdin=subprocess.DEVNULL)
        log.append(proc.stdout[-1500:] + proc.stderr[-1500:])
        if proc.returncode != 0:
            break
    path = _find_chromium()
    if not path:
        pytest.skip("could not install Chromium with apt-get:\n" + "\n".join(log))
    return path


def _browse(chromium: str, page: Path, *extra: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               "--enable-logging=stderr", "--v=0", *extra, page.as_uri()],
                              capture_output=True, text=True, timeout=180,
                              stdin=subprocess.DEVNULL)


def page_status(chromium: str, page: Path) -> tuple[dict[str, str], str, list[str]]:
    """(status attributes, the DOM, console lines Chromium logged) of the loaded page."""
    proc = _browse(chromium, page, "--dump-dom")
    m = re.search(r'<div id="epscale-status"([^>]*)>([^<]*)', proc.stdout)
    assert m, f"no status element in the DOM; chromium said:\n{proc.stderr[-3000:]}"
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(1)))
    attrs["text"] = m.group(2)
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    return attrs, proc.stdout, console


def _report(tmp_path: Path, name: str, **scenario) -> Path:
    run = load_run(make_run(tmp_path / name, **scenario))
    rules = AlertRules()
    return write_report(run, evaluate(run, rules, now=NOW), rules, tmp_path / f"{name}.html", now=NOW)


SCENARIOS = {
    "pathological": dict(collapse_layer=1, dead={0: [2]}, straggler_rank=2, straggler_from=40,
                         nan_at=(30,), spike_at=(50,), layers=3, ep=4, steps=80,
                         dp=2, layout_change_at=(44, 70)),
    "healthy": dict(),
    "minimal_truncated": dict(minimal=True, truncate_last=True),
    "many_experts_long": dict(steps=1500, experts=64, layers=1, ep=8, dp=4),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_plot_draws_without_errors(chromium, tmp_path, name):
    page = _report(tmp_path, name, **SCENARIOS[name])
    attrs, dom, console = page_status(chromium, page)
    expected = int(attrs["data-expected"])
    assert attrs["data-done"] == "1", attrs
    assert expected >= 5 and int(attrs["data-drawn"]) == expected, attrs["text"]
    assert attrs["data-errors"] == "0", attrs["text"]
    assert console == [], console
    # each plot box carries its own mark and holds an SVG or a canvas
    boxes = re.findall(r'<div class="plot" data-plot="(\w+)"[^>]*data-drawn="(\d)"', dom)
    assert len(boxes) == expected and all(flag == "1" for _k, flag in boxes), boxes
    assert dom.count("<svg") + dom.count("<canvas") >= expected


def test_a_broken_page_is_caught(chromium, tmp_path):
    """The checks above can fail: a plot without data and a console error are reported."""
    page = _report(tmp_path, "broken", steps=30)
    html = page.read_text()
    html = html.replace('data-plot="loss"', 'data-plot="no_such_plot"', 1)
    html = html.replace("</body>", "<script>console.error('deliberate');</script></body>")
    page.write_text(html)
    attrs, _dom, console = page_status(chromium, page)
    assert int(attrs["data-drawn"]) == int(attrs["data-expected"]) - 1
    assert int(attrs["data-errors"]) == 2 and "unknown plot kind no_such_plot" in attrs["text"]
    assert any("deliberate" in line for line in console)


def test_screenshot_shows_drawn_plots(chromium, tmp_path):
    PIL = pytest.importorskip("PIL.Image", reason="Pillow comes with matplotlib (monitor extra)")
    page = _report(tmp_path, "shot", collapse_layer=0, layers=2, steps=60)
    shot = tmp_path / "shot.png"
    proc = _browse(chromium, page, "--window-size=1280,2200", f"--screenshot={shot}")
    assert shot.is_file(), proc.stderr[-3000:]
    img = PIL.open(shot).convert("RGB")
    assert img.size == (1280, 2200)
    # the collapsed layer's heatmap paints a large near-black block ("no tokens", #101828)
    # and the line charts add coloured strokes: count distinct colours and dark pixels
    import numpy as np

    px = np.asarray(img.resize((320, 550))).reshape(-1, 3)
    colours = len(np.unique(px, axis=0))
    dark = int((px.max(axis=1) <= 48).sum())
    assert colours > 200, colours
    assert dark > 500, dark
