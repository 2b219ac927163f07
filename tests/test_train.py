"""The training loop on scikit-learn's bundled digits (8 x 8): overfitting, exact resume, signals,
NaN losses and DDP equivalence."""

from __future__ import annotations

import json
import os
import signal
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

pytest.importorskip("sklearn")

from vitscope.data.transforms import TrainTransform  # noqa: E402
from vitscope.errors import VitscopeError  # noqa: E402
from vitscope.models import create_model  # noqa: E402
from vitscope.training import classify  # noqa: E402
from vitscope.training.checkpointing import CheckpointError  # noqa: E402
from vitscope.training.loop import NonFiniteLoss, TrainConfig, train  # noqa: E402
from vitscope.training.options import ImageOptions  # noqa: E402

TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0,
        "class_token": False, "global_pool": "avg"}


def tiny_config(**kw) -> TrainConfig:
    """A tiny classifier's run; `kw` may hold TrainConfig's fields and the image options' (model_args=...)."""
    base = dict(model="vit_tiny_patch4_28", model_args=dict(TINY), dataset="digits", epochs=2, batch_size=64,
                lr=1e-2, warmup_epochs=0.3, amp="fp32", explain_images=0, threads=1,
                augment=TrainTransform(crop="none", flip=False))
    base.update(kw)
    image = {k: base.pop(k) for k in list(base) if k in ImageOptions.__dataclass_fields__}
    return TrainConfig(**base, image=ImageOptions(**image))


def weights(run_dir, name="last.safetensors"):
    return load_file(str(run_dir / name))


def assert_same_weights(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for k in a:
        if atol == 0.0:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def test_tiny_model_overfits_a_tiny_batch():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", in_chans=1, **TINY)
    x, y = torch.randn(16, 1, 8, 8), torch.arange(16) % 10
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    assert (model(x).argmax(1) == y).all()


def test_training_learns_and_writes_the_run(tmp_path):
    res = train(tiny_config(epochs=8), tmp_path, progress=False)
    assert res.value > 0.6  # 10 classes: chance is 0.1
    for name in ("config.json", "metrics.jsonl", "best.safetensors", "last.safetensors", "checkpoint.json",
                 "step-00000176.safetensors", "step-00000176.state.pt", "curves.png", "confusion.png",
                 "summary.json"):
        assert (tmp_path / name).is_file(), name
    # one checkpoint, the last: earlier steps' files are gone, last.safetensors is the same file
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000176.safetensors", "step-00000176.state.pt"]
    assert (tmp_path / "last.safetensors").samefile(tmp_path / "step-00000176.safetensors")
    assert not list(tmp_path.glob(".*"))  # no temporary files, no lock
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 8


def test_the_progress_bar_leaves_the_evaluations_out_of_its_rate(tmp_path, monkeypatch):
    """Each epoch's evaluation pauses training; the bar's rate (its time left) must not count that pause as a
    step's time. On a fake clock, a step takes 1 s and an evaluation 1000 s: the bar's elapsed time at the end
    holds the steps alone, however fast or slow the machine is."""
    import vitscope.training.progress as progress_module  # the bar is the Meter's

    clock = {"t": 0.0}
    real_evaluate, real_loss = classify.evaluate, classify.soft_cross_entropy

    def slow_evaluate(*a, **k):
        clock["t"] += 1000.0
        return real_evaluate(*a, **k)

    def one_second_step(*a, **k):
        clock["t"] += 1.0
        return real_loss(*a, **k)

    bars = []

    class Bar(progress_module.tqdm):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._time = lambda: clock["t"]
            self.start_t = self.last_print_t = clock["t"]
            self.mininterval = 0  # every update prints, so a pause starts at the last step
            bars.append(self)

    monkeypatch.setattr(classify, "evaluate", slow_evaluate)
    monkeypatch.setattr(classify, "soft_cross_entropy", one_second_step)
    monkeypatch.setattr(progress_module, "tqdm", Bar)
    train(tiny_config(epochs=2), tmp_path, progress=True)
    (bar,) = bars
    assert bar.n == 44 and bar.format_dict["elapsed"] == pytest.approx(44.0)  # 2 x 22 steps, no evaluation


def test_the_final_evaluation_averages_ten_views_and_the_summary_says_so(tmp_path):
    import json

    from vitscope.data import load_dataset
    from vitscope.training.loop import evaluate
    from vitscope.weights.model_io import load_model

    res = train(tiny_config(epochs=1, eval_flip=True, final_eval_shift=1), tmp_path, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    last_epoch = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["test_views"] == 10 and summary["last_epoch_test_acc"] == last_epoch["test_acc"]
    train_set, data = load_dataset("digits", "train"), load_dataset("digits", "test")
    model = load_model(tmp_path / "last.safetensors")
    want = evaluate(model, data, train_set.mean, train_set.std, flip=True, shift=1)
    assert summary["test_acc"] == res.value == pytest.approx(want["acc"])
    two = evaluate(model, data, train_set.mean, train_set.std, flip=True)
    assert two["acc"] == pytest.approx(last_epoch["test_acc"])
    assert two["loss"] != pytest.approx(want["loss"], rel=1e-6)  # the shifted views did count


def test_a_given_mean_and_std_are_the_ones_used_and_saved(tmp_path):
    import json

    from vitscope.weights.model_io import read_metadata

    cfg = tiny_config(epochs=1, augment=TrainTransform(crop="none", flip=False, mean=(0.3,), std=(0.2,)))
    train(cfg, tmp_path, progress=False, max_steps=1)
    meta = read_metadata(tmp_path / "last.safetensors")
    assert json.loads(meta["mean"]) == [0.3] and json.loads(meta["std"]) == [0.2]
    saved = TrainConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    assert saved == cfg  # so a resumed run normalises the same way
    with pytest.raises(ValueError, match="one number per channel, 1 for digits"):
        train(tiny_config(augment=TrainTransform(mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))), tmp_path / "b")


def test_same_config_and_seed_give_the_same_numbers(tmp_path):
    a = train(tiny_config(epochs=1), tmp_path / "a", progress=False)
    b = train(tiny_config(epochs=1), tmp_path / "b", progress=False)
    assert a.value == b.value
    assert_same_weights(weights(tmp_path / "a"), weights(tmp_path / "b"))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_mid_epoch_is_bit_identical(tmp_path, optimizer):
    # Muon runs with a conv stem, so that its kernels' 2-D views are resumed too
    stem = {"stem": [(8, 1), (16, 2)]} if optimizer == "muon" else {}
    cfg = tiny_config(epochs=2, optimizer=optimizer, model_args={**TINY, "drop_path_rate": 0.1, **stem},
                      augment=TrainTransform(crop="pad", pad=1, flip=True, mixup_alpha=0.2, erase_p=0.25))
    train(cfg, tmp_path / "full", progress=False)
    part = train(cfg, tmp_path / "cut", progress=False, max_steps=30)  # 22 steps an epoch: stops mid-epoch 2
    assert part.stopped == "finished" and not (tmp_path / "cut" / "summary.json").exists()
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert_same_weights(weights(tmp_path / "full"), weights(tmp_path / "cut"))


def test_evaluations_inside_the_epoch_log_rows_and_change_nothing_else(tmp_path):
    # 22 steps an epoch: --eval-every-steps 8 adds rows at steps 8, 16 (epoch 1) and 24, 32, 40 (epoch 2)
    plain = train(tiny_config(epochs=2), tmp_path / "plain", progress=False)
    often = train(tiny_config(epochs=2, eval_every_steps=8), tmp_path / "often", progress=False)
    rows = [json.loads(r) for r in (tmp_path / "often" / "metrics.jsonl").read_text().splitlines()]
    steps = [8, 16, 22, 24, 32, 40, 44]
    assert [r["step"] for r in rows] == steps
    assert [r["epoch"] for r in rows] == [1 if s == 22 else 2 if s == 44 else round(s / 22, 4) for s in steps]
    times = [r["train_time_s"] for r in rows]
    assert times == sorted(times)
    # the evaluations draw no random numbers and leave the model training: the same weights and final rows
    assert_same_weights(weights(tmp_path / "plain"), weights(tmp_path / "often"))
    plain_rows = [json.loads(r) for r in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert [r["test_acc"] for r in plain_rows] == [rows[2]["test_acc"], rows[6]["test_acc"]]
    assert often.value == plain.value


def test_init_weights_starts_from_another_runs_weights(tmp_path):
    first = tmp_path / "first"
    train(tiny_config(epochs=1), first, progress=False)
    start = weights(first, "best.safetensors")
    # 0 steps of training: the model saved at step 0 is the file's; a resumed run would keep its own
    cfg = tiny_config(epochs=1, init_weights=str(first / "best.safetensors"), lr=1e-9, min_lr=0.0)
    train(cfg, tmp_path / "second", progress=False, max_steps=1)
    after = weights(tmp_path / "second")
    for k, v in start.items():
        torch.testing.assert_close(after[k], v, atol=1e-6, rtol=0, msg=k)
    # a missing file is refused when a run starts (a resumed run never reads it), before the directory exists
    with pytest.raises(ValueError, match="init_weights: no file"):
        train(tiny_config(init_weights=str(tmp_path / "missing.safetensors")), tmp_path / "third", progress=False)
    assert not (tmp_path / "third").exists()
    with pytest.raises(ValueError, match="give one"):
        tiny_config(init_weights=str(first / "best.safetensors"), pretrained=True)


def test_resume_from_a_damaged_or_missing_state_says_how_to_start_again(tmp_path):
    train(tiny_config(epochs=1), tmp_path, progress=False, max_steps=3)
    state = tmp_path / "step-00000003.state.pt"
    whole = state.read_bytes()
    state.write_bytes(whole[:100])
    with pytest.raises(CheckpointError, match=r"cannot resume .*step-00000003\.state\.pt is not the file "
                                              r"checkpoint\.json was written with.*vitscope train --config"):
        train(tiny_config(epochs=1), tmp_path, resume=True, progress=False)
    state.unlink()
    with pytest.raises(CheckpointError, match=r"cannot resume .*names step 3, but step-00000003\.state\.pt is "
                                              r"missing.*--weights-only"):
        train(tiny_config(epochs=1), tmp_path, resume=True, progress=False)
    state.write_bytes(whole)
    assert train(tiny_config(epochs=1), tmp_path, resume=True, progress=False).stopped == "finished"


def test_sigint_saves_and_resume_continues_exactly(tmp_path, monkeypatch):
    cfg = tiny_config(epochs=2)
    train(cfg, tmp_path / "full", progress=False)

    real = classify.soft_cross_entropy
    calls = {"n": 0}

    def interrupt_at_step_9(logits, target):
        calls["n"] += 1
        if calls["n"] == 9:
            os.kill(os.getpid(), signal.SIGINT)
        return real(logits, target)

    monkeypatch.setattr(classify, "soft_cross_entropy", interrupt_at_step_9)
    res = train(cfg, tmp_path / "cut", progress=False)
    assert res.stopped == "signal"
    assert (tmp_path / "cut" / "last.safetensors").is_file()
    monkeypatch.setattr(classify, "soft_cross_entropy", real)
    train(cfg, tmp_path / "cut", resume=True, progress=False)
    assert_same_weights(weights(tmp_path / "full"), weights(tmp_path / "cut"))


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real = classify.soft_cross_entropy
    calls = {"n": 0}

    def nan_after_first_epoch(logits, target):
        calls["n"] += 1
        loss = real(logits, target)
        return loss * float("nan") if calls["n"] > 25 else loss

    monkeypatch.setattr(classify, "soft_cross_entropy", nan_after_first_epoch)
    with pytest.raises(NonFiniteLoss, match=r"loss became nan at step 25 .*keeps its last good checkpoint, step 22 "
                                            r".*--resume would meet the same loss.*--lr LOWER --out NEW_DIR"):
        train(tiny_config(epochs=2), tmp_path, progress=False)
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 22  # the end of epoch 1, the last good one
    for t in weights(tmp_path).values():
        assert torch.isfinite(t).all()


def test_nan_loss_before_any_checkpoint_says_nothing_was_kept(tmp_path, monkeypatch):
    real = classify.soft_cross_entropy
    monkeypatch.setattr(classify, "soft_cross_entropy", lambda lg, t: real(lg, t) * float("nan"))
    with pytest.raises(NonFiniteLoss) as err:
        train(tiny_config(epochs=2), tmp_path / "run", progress=False)
    msg = str(err.value)
    assert isinstance(err.value, VitscopeError)  # the CLI prints it as its one line
    assert "at step 0 (epoch 1) before the run's first checkpoint, so nothing was kept" in msg
    assert "last.safetensors" not in msg and f"--out {tmp_path / 'run'} --overwrite" in msg
    assert not list((tmp_path / "run").glob("*.safetensors"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, run_dir: str, cfg_dict: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train(TrainConfig.from_dict(cfg_dict), run_dir, progress=False)


def test_two_gloo_processes_equal_one_process(tmp_path):
    cfg = tiny_config(epochs=1, augment=TrainTransform(crop="pad", pad=1, flip=True, mixup_alpha=0.2))
    one = train(cfg, tmp_path / "one", progress=False)
    mp.start_processes(_ddp_worker, args=(2, _free_port(), str(tmp_path / "two"), cfg.to_dict()),
                       nprocs=2, join=True, start_method="spawn")
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    # The key bias shifts every score of a query equally, so softmax makes its true gradient 0;
    # what reaches it is rounding noise, which AdamW normalises up to lr-sized steps. Summing the
    # gradients over two processes rounds differently, so only those rows may differ visibly.
    d = TINY["embed_dim"]
    for name in [k for k in a if k.endswith("attn.qkv.bias")]:
        kb_a, kb_b = a[name][d : 2 * d].clone(), b[name][d : 2 * d].clone()
        torch.testing.assert_close(kb_a, kb_b, atol=2e-4, rtol=0)
        a[name][d : 2 * d] = 0
        b[name][d : 2 * d] = 0
    assert_same_weights(a, b, atol=1e-6)
    summary = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(summary) == 1  # only rank 0 writes
    import json

    assert abs(json.loads(summary[0])["test_acc"] - one.value) < 0.01


def test_flip_evaluation_averages_the_logits_of_each_image_and_its_mirror():
    from vitscope.data import load_dataset
    from vitscope.training.loop import evaluate

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch4_28", in_chans=1, **TINY).eval()
    data = load_dataset("digits", "test")
    mean, std = (0.5,), (0.25,)
    res = evaluate(model, data, mean, std, batch_size=100, flip=True)
    with torch.no_grad():
        x = (data.images.float() / 255 - 0.5) / 0.25
        logits = (model(x) + model(x.flip(-1))) / 2
    y = data.labels
    assert res["acc"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert res["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    plain = evaluate(model, data, mean, std, batch_size=100)
    assert plain["loss"] != pytest.approx(res["loss"], rel=1e-5)  # the mirror images did count

    ten = evaluate(model, data, mean, std, batch_size=100, flip=True, shift=1)
    with torch.no_grad():  # the ten views built with torch's own reflect padding
        p = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
        h, w = x.shape[-2:]
        moves = [(1, 0), (-1, 0), (0, 1), (0, -1)]
        views = [x] + [p[..., 1 - dy : 1 - dy + h, 1 - dx : 1 - dx + w] for dx, dy in moves]
        logits = torch.stack([model(v) for v in views] + [model(v.flip(-1)) for v in views]).mean(0)
    assert ten["acc"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert ten["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)


def test_compile_options_turn_off_inductors_tiling_analysis_on_a_gpu_only():
    """torch 2.11's Inductor asserted in its coalesce tiling analysis on ViT-S/16's training step on a GPU;
    `--compile` turns it off there (benchmarks/RESULTS.md, NVIDIA H100), and this torch accepts the option."""
    from vitscope.training.loop import compile_options

    assert compile_options(torch.device("cpu")) == {}
    options = compile_options(torch.device("cuda"))
    assert options in ({}, {"triton.coalesce_tiling_analysis": False})
    f = torch.compile(lambda t: t * 2 + 1, options=options)
    assert torch.equal(f(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)
