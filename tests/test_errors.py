"""Each mistake a user can make, as the user meets it on the command line: one line on stderr, naming the value or
file and what to do, and exit code 2; and a bug inside vitscope, which keeps its traceback. (Killed runs, full disks
and read-only folders: tests/test_faults.py.)"""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vitscope.cli import main
from vitscope.models import create_model
from vitscope.weights.model_io import save_model

pytest.importorskip("sklearn")

TINY = {"img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2, "mlp_ratio": 2.0,
        "class_token": False, "global_pool": "avg"}
SETS = [x for k, v in TINY.items() for x in ("--set", f"{k}={json.dumps(v)}")]
TRAIN = ["train", "--model", "vit_tiny_patch4_28", *SETS, "--dataset", "digits", "--epochs", "1", "--batch-size",
         "128", "--amp", "fp32", "--threads", "1", "--no-progress", "--explain-images", "0", "--kernels", "false"]


def one_line_error(argv, capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"vitscope {argv[0]}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _model(num_classes: int = 10):
    torch.manual_seed(0)
    return create_model("vit_tiny_patch4_28", in_chans=1, num_classes=num_classes, **TINY)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    meta = {"classes": [str(i) for i in range(10)], "mean": [0.5], "std": [0.25], "dataset": "digits"}
    save_model(_model(), d / "good.safetensors", metadata=meta)
    nan = _model()
    with torch.no_grad():
        nan.head.weight.fill_(float("nan"))
    save_model(nan, d / "nan.safetensors", metadata=meta)
    save_model(_model(), d / "five.safetensors", metadata={**meta, "classes": ["a", "b", "c", "d", "e"]})
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8), dtype=np.uint8)).save(d / "img.png")
    (d / "a_file").write_text("not a folder")
    assert main([*TRAIN, "--out", str(d / "run")]) == 0
    return d


# -- 3: settings that cannot be right ---------------------------------------------------------------
@pytest.mark.parametrize("flags, expected", [
    (["--min-lr", "-1"], "min_lr must be a finite number in [0, "),
    (["--clip-grad", "-1"], "clip_grad must be a finite number in (0, inf); none turns clipping off, got -1.0"),
    (["--label-smoothing", "5"], "label_smoothing must be a finite number in [0, 1), got 5.0"),
    (["--warmup-epochs", "-1"], "warmup_epochs must be a finite number in [0, inf), got -1.0"),
    (["--lr", "nan"], "lr must be a finite number in (0, inf), got nan"),
    (["--seed", str(2**70)], "seed must be a whole number from 0 to 4294967295"),
    (["--set", "depth=0"], "depth must be at least 1 (a model with no blocks has nothing to train), got 0"),
    (["--set", "stem=xyz"], "stem is a list of [channels, stride] pairs"),
    (["--set", "drop_path_rate=2"], "drop_path_rate is a probability in [0, 1), got 2"),
    (["--set", "init_values=-1"], "init_values is LayerScale's starting scale, a finite number of at least 0"),
    (["--image-size", "100000"], "image_size 100000: a training step at 100000x100000 pixels"),
    (["--checkpoint-every-steps", "-1"], "checkpoint_every_steps must be at least 0"),
    (["--ema-decay", "1.5"], "ema_decay must be a finite number in (0, 1)"),
    (["--threads", str(10**12)], "threads is a number of CPU threads from 1 to 4096"),
    (["--aug-randaug-ops", str(10**12)], "randaug_ops is the number of ops applied to an image in turn, at most 16"),
    (["--aug-pad", str(10**12)], "pad must be smaller than the images' side (8x8 for digits)"),
    (["--captions-file", "captions.json"], "captions_file is a caption dataset's file, for --task caption"),
])
def test_a_training_setting_out_of_range_is_refused_before_any_work(flags, expected, tmp_path, capsys):
    err = one_line_error([*TRAIN, *flags, "--out", str(tmp_path / "run")], capsys)
    assert expected in err
    assert not (tmp_path / "run").exists()


def test_counts_of_eval_predict_and_explain_are_checked(files, capsys):
    good = str(files / "good.safetensors")
    assert "argument --num: must be at least 1, got -1" in one_line_error(
        ["explain", good, "--dataset", "digits", "--num", "-1", "--out", str(files / "x")], capsys)
    assert "argument --top-k: must be at least 1, got -3" in one_line_error(
        ["predict", good, str(files / "img.png"), "--top-k", "-3"], capsys)
    assert "argument --batch-size: must be at least 1, got -5" in one_line_error(
        ["eval", good, "--batch-size", "-5"], capsys)
    assert "argument --batch-size: must be at least 1, got 0" in one_line_error(["eval", good, "--batch-size", "0"],
                                                                                capsys)


def test_nan_weights_are_named_not_printed_as_nan_percent(files, capsys):
    err = one_line_error(["predict", str(files / "nan.safetensors"), str(files / "img.png")], capsys)
    assert "holds NaN or infinite weights (1 of " in err and "earlier checkpoint" in err


# -- 5: tracebacks before -----------------------------------------------------------------------------
def test_an_existing_file_as_out_is_one_line(files, capsys):
    f = str(files / "a_file")
    assert "is a file, where the run's folder goes" in one_line_error([*TRAIN, "--out", f], capsys)
    assert "is a file, where the run's folder goes" in one_line_error(
        ["eval", str(files / "good.safetensors"), "--out", f], capsys)
    assert "is a file, where the run's folder goes" in one_line_error(
        ["explain", str(files / "good.safetensors"), str(files / "img.png"), "--out", f], capsys)


@pytest.mark.parametrize("content, expected", [
    ("[]", "holds [], not a JSON object of training fields"),
    ("null", "holds null, not a JSON object of training fields"),
    ('{"epochs": "two"}', "epochs must be a whole number, got 'two'"),
    ('{"image": {"augment": {"flip": true, "wings": 2}}}', "augment: "),
    ('{"image": {"model_args": {"stem": "xyz"}}}', "stem is a list of [channels, stride] pairs"),
    ('{"image": {"wings": 2}}', "image: "),
])
def test_a_config_file_that_is_not_a_config(content, expected, files, tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(content)
    assert expected in one_line_error(["train", "--config", str(cfg), "--out", str(tmp_path / "run")], capsys)
    run = tmp_path / "resumed"
    shutil.copytree(files / "run", run)
    (run / "config.json").write_text(content)
    assert expected in one_line_error(["train", "--resume", str(run)], capsys)


def test_files_that_are_not_checkpoints_say_what_they_are(files, tmp_path, capsys):
    whole = (files / "good.safetensors").read_bytes()
    cases = {
        "text.safetensors": (b"hello, this is a text file\n" * 4, "is a text file, not a checkpoint"),
        "png.safetensors": ((files / "img.png").read_bytes(), "is a PNG image, not a checkpoint"),
        "pickle.safetensors": (pickle.dumps({"a": 1}), "is a Python pickle, not a checkpoint"),
        "cut.safetensors": (whole[: len(whole) // 2], "cannot be read"),
    }
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        err = one_line_error(["eval", str(tmp_path / name), "--dataset", "digits"], capsys)
        assert expected in err and name in err, err
    torch.save({"a": torch.zeros(2)}, tmp_path / "model.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "model.pt").read_bytes()[:300])
    assert "cut.pt cannot be read" in one_line_error(["predict", str(tmp_path / "cut.pt"), "x.png"], capsys)
    for name, obj, expected in [("tensor.pt", torch.zeros(3), "holds a Tensor, not a state dict"),
                                ("list.pt", [torch.zeros(3)], "holds a list, not a state dict"),
                                ("dict.pt", {"a": 1}, "holds a dict whose values are not all tensors")]:
        torch.save(obj, tmp_path / name)
        assert expected in one_line_error(["eval", str(tmp_path / name), "--dataset", "digits"], capsys)
    torch.save({"a": torch.zeros(1)}, tmp_path / "raw.pt", _use_new_zipfile_serialization=False, pickle_protocol=4)
    with open(tmp_path / "raw.pt", "ab") as f:
        f.write(b"garbage")
    one_line_error(["eval", str(tmp_path / "raw.pt"), "--dataset", "digits"], capsys)  # no torch warning lines


def test_a_state_dict_saved_by_torch_asks_for_what_the_cli_can_do(tmp_path, capsys):
    torch.save(_model().state_dict(), tmp_path / "sd.pt")
    err = one_line_error(["eval", str(tmp_path / "sd.pt"), "--dataset", "digits"], capsys)
    assert "no preset has their shape" in err and "save_model" in err and "num_heads=" not in err


def test_a_checkpoint_naming_fewer_classes_than_its_head(files, capsys):
    err = one_line_error(["predict", str(files / "five.safetensors"), str(files / "img.png")], capsys)
    assert "names 5 classes but its head has 10 outputs" in err


def _legacy_run(files, tmp_path):
    """The run's checkpoint in the layout from before manifests: last.safetensors + last.state.pt."""
    run = tmp_path / "run"
    shutil.copytree(files / "run", run)
    (run / "checkpoint.json").unlink()
    state = next(run.glob("step-*.state.pt"))
    state.rename(run / "last.state.pt")
    return run


def test_a_damaged_state_file_is_named(files, tmp_path, capsys):
    run = _legacy_run(files, tmp_path)
    state = run / "last.state.pt"
    whole = state.read_bytes()
    state.write_bytes(whole[: len(whole) // 3])
    err = one_line_error(["train", "--resume", str(run)], capsys)
    assert f"cannot resume {run}" in err and "last.state.pt cannot be read" in err
    s = torch.load(__import__("io").BytesIO(whole), weights_only=True)
    for key, bad, expected in [("generator", 5, "its 'generator' is a int, not a Tensor"),
                               ("generator", torch.zeros(3), "its 'generator' is not a random generator's state"),
                               ("step", "x", "its 'step' is a str, not a int")]:
        torch.save({**s, key: bad}, state)
        assert expected in one_line_error(["train", "--resume", str(run)], capsys)
    torch.save([1, 2], state)
    assert "last.state.pt holds a list, not a training state" in one_line_error(["train", "--resume", str(run)],
                                                                                 capsys)


def test_resume_takes_no_other_flags_and_weights_only_needs_resume(files, capsys):
    assert "drop the other training flags" in one_line_error(
        ["train", "--resume", str(files / "run"), "--overwrite"], capsys)
    assert "--weights-only goes with --resume" in one_line_error(["train", "--weights-only"], capsys)


# -- 7: one image decoder, one bomb limit ----------------------------------------------------------------
def test_every_command_refuses_an_image_over_the_one_pixel_limit(files, tmp_path, capsys, monkeypatch):
    from vitscope.data import DataError
    from vitscope.data.folder import load_image

    big = tmp_path / "big.png"
    Image.new("L", (120, 100), 128).save(big)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 100)  # 12,000 pixels: PIL itself only warns below 2x
    with pytest.raises(DataError, match="decompression bomb"):
        load_image(big, image_size=8, channels=1)  # the training data's decoder
    good = str(files / "good.safetensors")
    for argv in (["predict", good, str(big)], ["explain", good, str(big), "--out", str(tmp_path / "ex")]):
        err = one_line_error(argv, capsys)
        assert "big.png" in err and "decompression bomb" in err and "at most 10,000 pixels" in err


# -- a bug is not a usage error ---------------------------------------------------------------------------
def test_an_internal_error_keeps_its_traceback_and_exit_code_1(tmp_path):
    """A KeyError or ValueError raised inside vitscope is a bug: Python's traceback and exit code 1, not a line
    that blames the user's input."""
    import subprocess
    import sys

    for exc in ("KeyError('blocks.0')", "ValueError('internal')"):
        code = ("import sys, vitscope.models as m\n"
                f"def broken(pattern='*'): raise {exc}\n"
                "m.list_models = broken\n"
                "from vitscope.cli import main\n"
                "sys.exit(main(['models']))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        assert "Traceback" in r.stderr and "in broken" in r.stderr and "vitscope models: error" not in r.stderr


def test_vitscopes_own_errors_are_one_line_and_still_the_builtin_kind():
    """A bad setting is a ConfigError, which the CLI prints as one line, and still a ValueError for a caller's
    `except ValueError`; each error type a user's input raises shares the VitscopeError base."""
    from vitscope.cli.common import UsageError
    from vitscope.cli.explain import ExplainError
    from vitscope.data.base import DataError
    from vitscope.errors import ConfigError, InputError, VitscopeError
    from vitscope.inspect.capture import CaptureTooLarge
    from vitscope.training.checkpointing import CheckpointError
    from vitscope.training.run_dir import RunDirError
    from vitscope.vit import ViTConfig
    from vitscope.weights.pretrained import WeightsError

    for kind in (UsageError, ExplainError, DataError, ConfigError, InputError, CaptureTooLarge, CheckpointError,
                 RunDirError, WeightsError):
        assert issubclass(kind, VitscopeError), kind
    assert issubclass(ConfigError, ValueError) and issubclass(InputError, ValueError)
    assert issubclass(WeightsError, RuntimeError) and issubclass(CaptureTooLarge, MemoryError)
    with pytest.raises(ConfigError, match="embed_dim=30 is not divisible by num_heads=4"):
        ViTConfig(embed_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="depth must be a whole number"):
        ViTConfig(depth="two")


def test_a_bad_model_setting_is_one_line_with_exit_code_2(capsys, tmp_path):
    err = one_line_error([*TRAIN, "--set", "num_heads=3", "--out", str(tmp_path / "run")], capsys)
    assert "embed_dim=16 is not divisible by num_heads=3" in err



@pytest.mark.parametrize("flags,words", [
    (["--set", "embed_dim=1000000000000"], ["the model", "parameters", "GiB", "embed_dim, depth"]),
    (["--set", "depth=100000000", "--set", "embed_dim=1024"], ["the model", "parameters", "GiB"]),
])
def test_a_model_larger_than_memory_is_refused_before_any_work(flags, words, tmp_path, capsys):
    out = tmp_path / "run"
    err = one_line_error([*TRAIN, *flags, "--out", str(out)], capsys)
    assert all(w in err for w in words), err
    assert not out.exists()  # refused before the run folder was made


@pytest.mark.parametrize("flags", [["--decoder-set", "dim=1000000"],
                                   ["--captioner", "lstm", "--decoder-set", "embed_dim=1000000000000"]])
def test_a_decoder_larger_than_memory_is_refused_before_any_work(flags, tmp_path, capsys):
    out = tmp_path / "run"
    err = one_line_error(["train", "--task", "caption", "--init-weights", "none", *flags, "--out", str(out)], capsys)
    assert "the decoder" in err and "--decoder-set" in err, err
    assert not out.exists()


def test_torchs_refusal_to_allocate_is_one_line(monkeypatch, capsys):
    """Whatever the checks miss (a batch, a forward), torch's allocator error is out of memory in one line."""
    from vitscope.cli import bench

    def alloc(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 64000000000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(bench, "run_bench", alloc)
    err = one_line_error(["bench"], capsys)
    assert "out of memory" in err and "59,604.6 GiB" in err and "--batch-size" in err, err


@pytest.mark.parametrize("flags,words", [
    (["--aug-mixup-alpha", "nan"], ["mixup_alpha", "finite", "nan"]),
    (["--aug-cutmix-alpha", "inf"], ["cutmix_alpha", "finite"]),
    (["--aug-randaug-ops", "-1"], ["randaug_ops", "at least 0"]),
    (["--aug-randaug-magnitude", "99"], ["randaug_magnitude", "0..30"]),
    (["--aug-rrc-scale", "0.5", "2"], ["rrc_scale", "at most 1"]),
    (["--aug-rrc-ratio", "1", "inf"], ["rrc_ratio", "finite"]),
    (["--aug-mean", "nan"], ["mean", "finite"]),
    (["--aug-std", "0"], ["std", "above 0"]),
    (["--device", "mps"], ["device", "auto, cpu, cuda or cuda:N", "mps"]),
    (["--device", "cuda:x"], ["device", "cuda:x"]),
])
def test_every_augmentation_number_and_the_device_are_checked_before_any_work(flags, words, tmp_path, capsys):
    out = tmp_path / "run"
    err = one_line_error([*TRAIN, *flags, "--out", str(out)], capsys)
    assert all(w in err for w in words), err
    assert not out.exists()


@pytest.mark.parametrize("argv", [["train", "--out", ""], ["eval", "run", "--out", " "],
                                  ["explain", "run", "--out", ""]])
def test_an_empty_out_is_refused_not_read_as_the_current_folder(argv, capsys):
    err = one_line_error(argv, capsys)
    assert "--out" in err and "empty path" in err, err


@pytest.mark.parametrize("task,flag,value", [
    ("caption", "--max-len", "-1"), ("caption", "--eval-beam", "0"), ("caption", "--vocab-min-count", "0"),
    ("translate", "--eval-beam", "0"), ("translate", "--test-sentences", "0"), ("translate", "--max-words", "-1"),
])
def test_a_task_option_out_of_range_is_refused_before_any_work(task, flag, value, tmp_path, capsys):
    """Each task checks its own options (training/options.py); a classification run refuses them whole, below."""
    out = tmp_path / "run"
    err = one_line_error(["train", "--task", task, "--init-weights", "none", flag, value, "--out", str(out)], capsys)
    assert flag[2:].replace("-", "_") in err and value in err, err
    assert not out.exists()


@pytest.mark.parametrize("flag,value", [("--max-len", "-1"), ("--eval-beam", "0"), ("--test-sentences", "0")])
def test_another_tasks_option_in_a_classification_run_is_refused_whole(flag, value, tmp_path, capsys):
    out = tmp_path / "run"
    err = one_line_error([*TRAIN, flag, value, "--out", str(out)], capsys)
    assert f"--task classify: {flag} would be ignored" in err, err
    assert not out.exists()


def test_a_nan_loss_is_one_line_on_the_command_line(tmp_path, capsys):
    """NonFiniteLoss is a RuntimeError as well as a VitscopeError: the CLI's out-of-memory clause, which
    re-raises every other RuntimeError, must not take it first."""
    err = one_line_error([*TRAIN, "--lr", "1e30", "--out", str(tmp_path / "run")], capsys)
    assert "loss became nan at step 1" in err and "--lr LOWER" in err, err
