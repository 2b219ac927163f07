"""A training killed or failing at the dangerous points either resumes to the uninterrupted run's weights,
bit for bit, or refuses in one clear line; never a silent wrong result (issue 48).

The kills are deterministic: a child process sets `vitscope.training.checkpointing.FAULT`, which SIGKILLs it
at a named point of the n-th checkpoint (before, during and between the writes of the weights, the state and
the manifest). A full disk is writes raising OSError(ENOSPC); a read-only folder, one that refuses new files.
The campaign of random kills is scripts/kill_campaign.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("sklearn")

from vitscope.cli import main  # noqa: E402
from vitscope.data import DataError  # noqa: E402
from vitscope.data.transforms import TrainTransform  # noqa: E402
from vitscope.training import checkpointing, resume  # noqa: E402
from vitscope.training.checkpointing import CheckpointError  # noqa: E402
from vitscope.training.loop import TrainConfig, train  # noqa: E402
from vitscope.training.options import ImageOptions  # noqa: E402
from vitscope.training.run_dir import RunDirError, RunLock  # noqa: E402

TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0,
        "class_token": False, "global_pool": "avg", "drop_path_rate": 0.1}


def fault_config(**kw) -> TrainConfig:
    """11 steps an epoch, a checkpoint every 4 steps and at each epoch's end: steps 4, 8, 11, 12, 16, 20, 22.
    Drop-path and flips use both generators, so a wrongly restored random state shows."""
    base = dict(model="vit_tiny_patch4_28", model_args=dict(TINY), dataset="digits", epochs=2, batch_size=128,
                lr=1e-2, warmup_epochs=0.3, amp="fp32", explain_images=0, threads=1, kernels=False,
                checkpoint_every_steps=4, augment=TrainTransform(crop="pad", pad=1, flip=True))
    base.update(kw)
    image = {k: base.pop(k) for k in list(base) if k in ImageOptions.__dataclass_fields__}
    return TrainConfig(**base, image=ImageOptions(**image))


def run_child(point: str, nth: int, cfg: TrainConfig, run: Path, *, resume: bool = False) -> int:
    """Train in a child process that SIGKILLs itself the nth time it reaches `point`; the signal that ended it
    (0: it finished). A forked child starts in milliseconds, with torch and the data already loaded."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            seen = {}

            def fault(p):
                seen[p] = seen.get(p, 0) + 1
                if p == point and seen[p] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)

            checkpointing.FAULT = fault
            sys.stdout = sys.stderr = open(os.devnull, "w")
            train(cfg, run, resume=resume, progress=False)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, f"the child failed: {status}"
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0


def weights(run: Path) -> dict:
    return load_file(str(run / "last.safetensors"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def curve(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["epoch"], r["step"], r["train_loss"], r["test_acc"]) for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("faults") / "reference"
    train(fault_config(), run, progress=False)
    return run


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- SIGKILL at each dangerous point ------------------------------------------------------------------
# (point, which checkpoint of the process): the first kill comes at step 8, with step 4's checkpoint before it;
# each resume after it dies at its first checkpoint, of step 8 until after-manifest commits it, then of 11.
KILLS = [("before-weights", 2), ("during-weights", 1), ("after-weights", 1), ("after-state", 1),
         ("during-manifest", 1), ("after-manifest", 1), ("after-link", 1)]


def test_a_kill_at_every_point_of_a_checkpoint_resumes_bit_identically(reference, tmp_path):
    """One run, killed at each point in turn (each resume dies at the next point), then resumed to the end: the
    uninterrupted run's weights and curve, bit for bit, with no temporary files or stale checkpoints left."""
    cfg = fault_config()
    run = tmp_path / "run"
    for k, (point, nth) in enumerate(KILLS):
        assert run_child(point, nth, cfg, run, resume=k > 0) == signal.SIGKILL, point
        if point.startswith("during"):
            assert list(run.glob(".*.tmp")), point  # the killed write left its temporary file
    res = train(cfg, run, resume=True, progress=False)
    assert res.stopped == "finished"
    assert_same(weights(reference), weights(run))
    assert curve(run) == curve(reference)  # metrics.jsonl cut back on each resume: no epoch twice
    assert not list(run.glob(".*")), list(run.glob(".*"))  # stale .tmp files cleaned, the lock released
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000022.safetensors", "step-00000022.state.pt"]
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 22


@pytest.mark.slow
@pytest.mark.parametrize("point", [point for point, _ in KILLS])
def test_a_kill_at_one_point_resumes_bit_identically(reference, tmp_path, point):
    cfg = fault_config()
    assert run_child(point, 2, cfg, tmp_path / "run") == signal.SIGKILL
    train(cfg, tmp_path / "run", resume=True, progress=False)
    assert_same(weights(reference), weights(tmp_path / "run"))
    assert curve(tmp_path / "run") == curve(reference)


def test_a_kill_before_the_first_checkpoint_is_refused_and_overwrite_starts_again(reference, tmp_path, capsys):
    cfg = fault_config()
    run = tmp_path / "run"
    assert run_child("during-weights", 1, cfg, run) == signal.SIGKILL
    before = snapshot(run)
    with pytest.raises(CheckpointError, match=r"holds no checkpoint yet .*--overwrite"):
        train(cfg, run, resume=True, progress=False)
    assert snapshot(run) == before  # a refused start leaves the folder as it was
    with pytest.raises(RunDirError, match=r"already holds a run .*--resume .*--out.*--overwrite"):
        train(cfg, run, progress=False)
    train(cfg, run, overwrite=True, progress=False)
    assert_same(weights(reference), weights(run))
    assert not list(run.glob(".*"))


def test_a_sigint_mid_epoch_saves_and_resumes_exactly(reference, tmp_path):
    cfg = fault_config()
    run = tmp_path / "run"
    res = train(cfg, run, progress=False, max_steps=6)  # a stop between the checkpoints at 4 and 8
    assert res.stopped == "finished" and json.loads((run / "checkpoint.json").read_text())["step"] == 6
    train(cfg, run, resume=True, progress=False)
    assert_same(weights(reference), weights(run))
    assert curve(run) == curve(reference)  # the resumed epoch reports the same training loss
    assert not list(run.glob(".*.tmp"))  # no temporary file left behind


def test_relinking_last_to_the_file_it_already_names_leaves_no_temporary_file(tmp_path):
    """A resume links last.safetensors to the weights it already names: a rename of a link onto its own file
    succeeds without removing the link's temporary name, which stayed behind."""
    weights_file = tmp_path / "step-00000004.safetensors"
    weights_file.write_bytes(b"weights")
    ckpt = checkpointing.Checkpoint(tmp_path, 4, weights_file, None, None)
    checkpointing.link_last(ckpt)
    checkpointing.link_last(ckpt)
    assert (tmp_path / "last.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.safetensors", "step-00000004.safetensors"]


# -- a mixed pair, a changed file -------------------------------------------------------------------
def _legacy(run: Path, weights_step: int, state_step: int) -> None:
    """The layout of runs from before manifests: last.safetensors beside last.state.pt, of these steps."""
    for p in run.glob("step-*"):
        p.unlink()
    (run / "checkpoint.json").unlink()
    (run / "last.safetensors").unlink()
    shutil.copy(run.parent / f"w{weights_step}", run / "last.safetensors")
    shutil.copy(run.parent / f"s{state_step}", run / "last.state.pt")


def test_a_mixed_pair_is_refused_and_a_whole_one_resumes(reference, tmp_path, capsys):
    cfg = fault_config()
    run = tmp_path / "run"

    def keep(point):  # keep each checkpoint's files as they are committed
        if point == "after-manifest":
            step = json.loads((run / "checkpoint.json").read_text())["step"]
            shutil.copy(run / f"step-{step:08d}.safetensors", tmp_path / f"w{step}")
            shutil.copy(run / f"step-{step:08d}.state.pt", tmp_path / f"s{step}")

    checkpointing.FAULT = keep
    try:
        train(cfg, run, progress=False, max_steps=8)
    finally:
        checkpointing.FAULT = None
    _legacy(run, 8, 4)  # new weights beside old state: the window issue 48 found
    before = snapshot(run)
    msg = r"mixed pair: last\.safetensors holds step 8 but last\.state\.pt step 4.*--weights-only"
    with pytest.raises(CheckpointError, match=msg):
        train(cfg, run, resume=True, progress=False)
    assert snapshot(run) == before
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mixed pair" in err and "\n" not in err
    # asked for, the weights alone continue the run (not bit-identically: the optimizer starts afresh)
    assert train(cfg, run, resume=True, weights_only=True, progress=False).stopped == "finished"
    assert "resuming" in capsys.readouterr().out
    assert (run / "checkpoint.json").is_file() and not (run / "last.state.pt").exists()

    whole = tmp_path / "whole"
    shutil.copytree(tmp_path / "run", whole)
    _legacy(whole, 8, 8)
    (whole / "metrics.jsonl").write_text("")
    train(cfg, whole, resume=True, progress=False)  # a legacy pair of one step resumes exactly
    assert_same(weights(reference), weights(whole))


def test_a_checkpoint_file_changed_since_it_was_written_is_refused(tmp_path):
    cfg = fault_config()
    run = tmp_path / "run"
    train(cfg, run, progress=False, max_steps=6)
    state = run / "step-00000006.state.pt"
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"step-00000006\.state\.pt is not the file checkpoint\.json was "
                                              r"written with"):
        train(cfg, run, resume=True, progress=False)


# -- a full disk, a read-only folder, a folder in use -----------------------------------------------
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(reference, tmp_path, monkeypatch, capsys):
    import vitscope.weights.model_io as ck

    cfg = fault_config()
    run = tmp_path / "run"
    real_save = ck.torch.save
    calls = {"n": 0}

    def full_disk(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint's state file
            with open(f, "wb") as out:
                out.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(CheckpointError) as err:
        train(cfg, run, progress=False)
    msg = str(err.value)
    assert "could not write the checkpoint of step 8" in msg and "No space left on device" in msg
    assert "the previous checkpoint, step 4 (step-00000004.safetensors + step-00000004.state.pt), is kept" in msg
    assert "vitscope train --resume" in msg
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 4
    assert sorted(p.name for p in run.glob("step-*")) == ["step-00000004.safetensors", "step-00000004.state.pt"]
    assert not list(run.glob(".*"))
    monkeypatch.setattr(ck.torch, "save", real_save)
    train(cfg, run, resume=True, progress=False)
    assert_same(weights(reference), weights(run))

    calls["n"] = 0
    monkeypatch.setattr(ck.torch, "save", full_disk)  # the same through the command line: one line, exit code 2
    out = tmp_path / "cli"
    flags = ["--model", "vit_tiny_patch4_28", "--dataset", "digits", "--epochs", "1", "--batch-size", "128",
             "--checkpoint-every-steps", "4", "--amp", "fp32", "--threads", "1", "--no-progress", "--explain-images",
             "0", "--kernels", "false"] + [x for k, v in TINY.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    capsys.readouterr()
    assert main(["train", *flags, "--out", str(out)]) == 2
    err_line = capsys.readouterr().err.strip()
    assert err_line.startswith("vitscope train: error: could not write the checkpoint of step 8")
    assert "\n" not in err_line


@pytest.fixture
def read_only(monkeypatch):
    """Make folders read-only: chmod, and for root (whom chmod does not stop) new files there refused."""
    folders: list[Path] = []
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):
        if dir is not None and any(Path(dir).resolve() == f.resolve() for f in folders):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)

    def make(folder: Path) -> Path:
        folder.chmod(0o555)
        folders.append(folder)
        return folder

    yield make
    for f in folders:
        f.chmod(0o755)


def test_a_read_only_folder_is_one_line_for_every_command(tmp_path, read_only, capsys):
    from vitscope.models import create_model
    from vitscope.weights.model_io import save_model

    run = tmp_path / "run"
    train(fault_config(), run, progress=False, max_steps=2)
    ckpt = tmp_path / "m.safetensors"
    save_model(create_model("vit_tiny_patch4_28", **{k: v for k, v in TINY.items() if k != "drop_path_rate"}),
               ckpt, metadata={"classes": [str(i) for i in range(10)], "dataset": "digits"})
    (tmp_path / "ro").mkdir()
    ro = read_only(tmp_path / "ro")
    read_only(run)
    before = snapshot(run)
    cases = [
        (["train", "--resume", str(run), "--no-progress"], f"cannot write in {run}"),
        (["train", "--dataset", "digits", "--out", str(ro / "new")], f"cannot write in {ro}"),
        (["eval", str(ckpt), "--out", str(ro / "ev")], f"cannot write in {ro}"),
        (["explain", str(ckpt), "--dataset", "digits", "--out", str(ro / "ex")], f"cannot write in {ro}"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert expected in err and "Permission denied" in err and "\n" not in err, (argv, err)
    assert snapshot(run) == before and not list(ro.iterdir())


def test_a_second_training_in_a_folder_in_use_is_refused_naming_the_holder(tmp_path):
    cfg = fault_config()
    run = tmp_path / "run"
    train(cfg, run, progress=False, max_steps=2)
    with RunLock(run):
        with pytest.raises(RunDirError, match=rf"in use by another training \(process {os.getpid()}"):
            train(cfg, run, resume=True, progress=False)
    train(cfg, run, resume=True, progress=False, max_steps=3)  # released: it trains
    # a lock left by a killed process holds nothing: the kill tests resume after SIGKILL


def test_a_finished_run_is_never_overwritten_by_surprise(tmp_path, capsys):
    cfg = fault_config(epochs=1)
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    before = snapshot(run)
    with pytest.raises(RunDirError, match=rf"{run} already holds a run \(config\.json, metrics\.jsonl"):
        train(cfg, run, progress=False)
    bad = fault_config(epochs=1, dataset="folder", data_dir=str(tmp_path / "nowhere"))
    assert main(["train", "--config", str(run / "config.json"), "--data-dir", str(tmp_path / "nowhere"),
                 "--dataset", "folder", "--out", str(run), "--overwrite", "--no-progress"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(DataError, match="is not a folder"):
        train(bad, run, overwrite=True, progress=False)
    assert snapshot(run) == before  # failed starts left every file as it was
    (tmp_path / "file").write_text("x")
    assert main(["train", "--dataset", "digits", "--out", str(tmp_path / "file")]) == 2
    assert "is a file, where the run's folder goes" in capsys.readouterr().err
    train(cfg, run, overwrite=True, progress=False)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


def test_checkpoints_every_n_steps_or_minutes(tmp_path, monkeypatch):
    steps = []

    def record(point):
        if point == "after-manifest":
            steps.append(json.loads((tmp_path / "a" / "checkpoint.json").read_text())["step"])

    monkeypatch.setattr(checkpointing, "FAULT", record)
    train(fault_config(), tmp_path / "a", progress=False)
    assert steps == [4, 8, 11, 12, 16, 20, 22]  # every 4 steps, and each epoch's end (11 steps an epoch)
    # minutes: on a clock where each step takes a minute, every step
    import vitscope.training.classify as classify
    import vitscope.training.loop as loop

    clock = {"t": 0.0}

    def step_a_minute(*a, **k):
        clock["t"] += 60.0
        return real(*a, **k)

    real = classify.soft_cross_entropy
    monkeypatch.setattr(classify, "soft_cross_entropy", step_a_minute)
    monkeypatch.setattr(loop.time, "monotonic", lambda: clock["t"])
    steps.clear()
    train(fault_config(checkpoint_every_steps=0, checkpoint_every_minutes=1.0, epochs=1), tmp_path / "a",
          overwrite=True, progress=False)
    assert steps == list(range(1, 12))


def test_a_damaged_manifest_is_refused_and_the_weights_alone_still_continue(tmp_path):
    cfg = fault_config()
    run = tmp_path / "run"
    train(cfg, run, progress=False, max_steps=6)
    (run / "checkpoint.json").write_text('{"step": 6, "files": {"weights": "../../elsewhere", "state": "x"}}')
    with pytest.raises(CheckpointError, match=r"checkpoint\.json is damaged .*--weights-only"):
        train(cfg, run, resume=True, progress=False)
    assert train(cfg, run, resume=True, weights_only=True, progress=False, max_steps=8).stopped == "finished"
    assert json.loads((run / "checkpoint.json").read_text())["step"] == 8


@pytest.mark.parametrize("damage", ["deleted", "a folder"])
def test_a_lost_manifest_is_named_not_the_old_layouts_state_file(reference, tmp_path, capsys, damage):
    run = tmp_path / "run"
    train(fault_config(), run, progress=False, max_steps=6)
    (run / "checkpoint.json").unlink()
    if damage == "a folder":
        (run / "checkpoint.json").mkdir()
    with pytest.raises(CheckpointError) as caught:
        resume.find_checkpoint(run)
    msg = str(caught.value)
    assert "checkpoint.json" in msg and ("is a folder" if damage == "a folder" else "is missing") in msg
    assert "step-00000006" in msg and "last.state.pt" not in msg and "--weights-only" in msg
    assert resume.find_checkpoint(run, weights_only=True).step == 6  # the way out it names works
