"""Stopping a run with a signal, as a scheduler or a user's Ctrl-C does: a tiny caption run in a child process
gets SIGTERM while training, while evaluating, or twice while saving. It must leave promptly (its evaluations
are made to last ten minutes, so only skipping or abandoning them ends it sooner), say so in one line, and
leave a checkpoint that resumes to the weights and metrics of a run that never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_caption_models import one_thread  # noqa: F401 (autouse)
from test_caption_train import tiny_caption_config, toy  # noqa: F401 (fixture)
from vitscope.training.loop import train

pytestmark = pytest.mark.usefixtures("toy")  # the parent's runs read the child's toy scenes
TESTS = Path(__file__).parent
CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_caption_train import tiny_caption_config, toy_scenes
    from vitscope.caption import builders as captioning
    from vitscope.training import caption, loop

    run_dir, mode = sys.argv[1], sys.argv[2]
    captioning.load_caption_dataset = lambda name, split, **kw: toy_scenes(split, 96 if split == "train" else 12)
    real_loss, real_save = caption.CaptionTask.loss, loop.save_checkpoint
    saves = []

    def loss(self, *a, **k):
        print("step", flush=True)
        time.sleep(0.2)  # the parent's signal lands while training
        return real_loss(self, *a, **k)

    def evaluate(self, *a, **k):
        print("evaluating", flush=True)
        time.sleep(600)  # only abandoning (or skipping) it ends the run within minutes
        raise AssertionError("an evaluation ran to its end")

    def save_checkpoint(*a, **k):
        saves.append(1)
        if mode == "slow-save" and len(saves) > 1:
            print("saving", flush=True)
            time.sleep(600)  # a second signal must end this at once
        return real_save(*a, **k)

    caption.CaptionTask.loss, caption.CaptionTask.evaluate, loop.save_checkpoint = loss, evaluate, save_checkpoint
    cfg = tiny_caption_config(epochs=2, explain_images=0, checkpoint_every_steps=2 if mode == "slow-save" else 0)
    print("stopped:", loop.train(cfg, run_dir, progress=False).stopped, flush=True)
""").format(tests=str(TESTS))


def start_child(run_dir: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(child: subprocess.Popen, line: str, times: int = 1) -> list[str]:
    seen = []
    for text in child.stdout:
        seen.append(text.rstrip("\n"))
        if sum(s == line for s in seen) >= times:
            return seen
    raise AssertionError(f"the child ended before printing {line!r}: {seen}")


def finish(child: subprocess.Popen) -> tuple[int, list[str]]:
    """The child's exit code and the rest of its output (a 10-minute evaluation or save makes anything but a
    prompt exit take far longer than the wait)."""
    try:
        out, _ = child.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        child.kill()
        raise AssertionError("the run did not stop within 4 minutes of the signal") from None
    return child.returncode, out.splitlines()


def rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in ("train_time_s", "train_cpu_s", "images_per_s")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "last.safetensors")), load_file(str(b / "last.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert rows(a) == rows(b)


@pytest.mark.parametrize("when", ["training", "evaluating"])
def test_sigterm_saves_skips_the_evaluation_and_the_checkpoint_resumes(tmp_path, when):
    """12 steps an epoch: SIGTERM after the third step, or inside the first epoch's evaluation."""
    run = tmp_path / "run"
    child = start_child(run, "slow-eval")
    wait_for(child, "step", 3) if when == "training" else wait_for(child, "evaluating")
    child.send_signal(signal.SIGTERM)
    code, out = finish(child)
    assert code == 0 and out[-1] == "stopped: signal", out
    (said,) = [line for line in out if line.startswith("SIGTERM")]
    step = json.loads((run / "checkpoint.json").read_text())["step"]
    assert said == (f"SIGTERM: stopped by the signal at step {step}, its checkpoint saved; the final evaluation "
                    f"skipped. Continue with: vitscope train --resume {run}")
    assert 3 <= step < 12 if when == "training" else step == 12
    assert not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text()  # none finished

    cfg = tiny_caption_config(epochs=2, explain_images=0)
    assert train(cfg, run, resume=True, progress=False).stopped == "finished"  # evaluates the epoch it missed
    train(cfg, tmp_path / "whole", progress=False)
    assert_same_run(tmp_path / "whole", run)


def test_a_second_signal_leaves_at_once_and_the_committed_checkpoint_survives(tmp_path):
    """The second checkpoint (step 4) takes ten minutes to write: SIGTERM asks the run to stop after it, and a
    Ctrl-C then ends the run there. The step-2 checkpoint stays the run's, and resumes."""
    run = tmp_path / "run"
    child = start_child(run, "slow-save")
    wait_for(child, "saving")
    child.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the first signal is handled before the second comes
    child.send_signal(signal.SIGINT)
    code, out = finish(child)
    assert code != 0 and "KeyboardInterrupt" in "\n".join(out)
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 2

    cfg = tiny_caption_config(epochs=2, explain_images=0, checkpoint_every_steps=2)
    assert train(cfg, run, resume=True, progress=False).stopped == "finished"
    train(cfg, tmp_path / "whole", progress=False)
    assert_same_run(tmp_path / "whole", run)
