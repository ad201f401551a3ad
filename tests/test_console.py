"""The console a person reads: a progress bar per training phase, third-party chatter in the log file."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

from tasks import settings
from tasks.context import PROGRESS_TAG, PhaseProgress, TrainContext
from tasks.train import PhaseBars, parse_progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rank_progress_lines_render_as_a_bar_or_as_tenths(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PAPERLINE_PROGRESS", "lines")
    monkeypatch.setattr(PhaseProgress, "INTERVAL_S", 0.0)
    ctx = TrainContext(params=None, data_dir=tmp_path, out_dir=tmp_path, label="sei train")
    bar = PhaseProgress(ctx, "detect", 0, 50)
    for step in range(1, 51):
        bar.update(step, 1.0 / step)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 51 and all(line.startswith(PROGRESS_TAG) for line in lines)
    infos = [parse_progress(line) for line in lines]
    assert infos[-1] == {"label": "sei train", "phase": "detect", "step": 50, "start": 0, "total": 50, "loss": 0.02}
    assert parse_progress("[rank0]: some other line") is None

    plain = io.StringIO()  # a pipe or a log: a line per tenth, with an ETA
    bars = PhaseBars(plain)
    for info in infos:
        bars.show(info)
    shown = plain.getvalue().splitlines()
    assert len(shown) == 9 and shown[-1].startswith("[sei train detect] step 45/50 loss 0.0222")
    assert "ETA" in shown[0]

    tty = _Tty()  # a terminal: one bar updated in place, other lines above it
    bars = PhaseBars(tty)
    for info in infos:
        bars.show(info)
    bars.print("[sei train] phase detect: step 50/50 loss 0.0200 (50 steps in 1.0 s, 50.0 it/s)\n")
    bars.print("[sei train] something else\n")
    bars.close()
    out = tty.getvalue()
    assert "sei train detect" in out and "50/50" in out and "ETA" in out and "something else" in out
    assert "phase detect: step 50/50" not in out  # the finished bar says it; the line is in train.log


def test_in_process_progress_stays_plain(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("PAPERLINE_PROGRESS", raising=False)
    ctx = TrainContext(params=None, data_dir=tmp_path, out_dir=tmp_path, label="x train")
    bar = PhaseProgress(ctx, "fit", 0, 20)
    for step in range(1, 21):
        bar.update(step, 0.5)
    bar.done(0.5)
    err = capsys.readouterr().err
    assert PROGRESS_TAG not in err and err.count("phase fit: step") == 10 and err.count("step 20/20") == 1


def test_chatter_goes_to_the_log_file_warnings_to_the_console(monkeypatch, tmp_path, capsys):
    log_file = tmp_path / "run.log"
    monkeypatch.setenv("PAPERLINE_LOG", str(log_file))
    monkeypatch.delenv("PAPERLINE_VERBOSE", raising=False)
    name = "paperline-test-chatter"
    logger = logging.getLogger(name)
    console = logging.StreamHandler()  # like DVC's and MLflow's own console handlers
    logger.addHandler(console)
    try:
        settings.route_chatter(name)
        logger.info("To track the changes with git, run: git add dvc.lock")
        logger.warning("a real warning")
        for h in logger.handlers:
            h.flush()
        err = capsys.readouterr().err
        assert "git add dvc.lock" not in err and "a real warning" in err
        assert err.count("a real warning") == 1  # not again through the root logger
        text = log_file.read_text()
        assert "git add dvc.lock" in text and "a real warning" in text
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
            h.close()
    json.dumps(settings.QUIET_DEFAULTS)  # plain strings: environment defaults



def test_engine_clips_gradients_as_asked(tmp_path):
    """`grad_clip` is the clip of the engine's network: 1.0 (DeepSpeed's own default, every run so far) unless a
    paper says otherwise (lock-step arms in one engine share the clip: motionmar turns it off). On one rank without
    ZeRO the optimizer applies it (DeepSpeed's `gradient_clipping` is 0: its clip would all-reduce the norm every
    step); with ZeRO, DeepSpeed's config carries it. In a child process: DeepSpeed's communication state, once set
    up, would outlive the test in this one."""
    import os
    import socket
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from models.contract import PaperParams\n"
        "from tasks.context import TrainContext\n"
        "def clips(zero, **kw):\n"
        f"    ctx = TrainContext(params=PaperParams(zero_stage=zero), data_dir={str(tmp_path)!r}, "
        f"out_dir={str(tmp_path)!r})\n"
        "    engine = ctx.engine(torch.nn.Linear(2, 2), 1e-3, **kw)\n"
        "    groups = engine.optimizer.param_groups if zero == 0 else engine.optimizer.optimizer.param_groups\n"
        "    return engine.gradient_clipping(), [g['max_norm'] for g in groups]\n"
        "print([clips(0), clips(0, grad_clip=0), clips(1)])\n"
    )
    with socket.socket() as free:  # a port nothing else holds (another test's rendezvous may hold a fixed one)
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=settings.root())
    # (DeepSpeed's clip, the optimizer's per group): ZeRO 0 default, ZeRO 0 no clip, ZeRO 1 default
    assert out.stdout.strip().splitlines()[-1] == "[(0.0, [1.0]), (0.0, [0.0]), (1.0, [0.0])]", out.stderr[-2000:]


def test_extension_builds_are_shared_by_every_checkout_on_one_venv(monkeypatch, tmp_path):
    """DeepSpeed's CPU op is compiled against the venv's torch: a second checkout (a git worktree) on the same venv
    finds the build `make setup` made instead of compiling it inside its first replicate."""
    import sys

    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    assert settings.extensions_dir() == (tmp_path / "venv").resolve() / ".cache" / "torch_extensions"
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # no venv: the project's own folder
    checkout = Path(settings.__file__).resolve().parents[1]
    assert settings.extensions_dir() == checkout / ".cache" / "torch_extensions"
