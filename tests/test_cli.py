"""The command line end to end on a tiny dataset, and its error paths (one line, exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from vitscope.cli import main

pytest.importorskip("sklearn")

TINY = ["--model", "vit_tiny_patch4_28", "--set", "img_size=8", "--set", "patch_size=2", "--set", "embed_dim=32",
        "--set", "depth=2", "--set", "num_heads=2", "--set", "class_token=false", "--set", "global_pool=\"avg\"",
        "--dataset", "digits", "--epochs", "2", "--batch-size", "64", "--lr", "0.01", "--amp", "fp32",
        "--aug-crop", "none", "--aug-flip", "false", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *TINY, "--explain-images", "2", "--out", str(out)]) == 0
    return out


def test_train_writes_a_complete_run(run_dir, capsys):
    cfg = json.loads((run_dir / "config.json").read_text())
    image = cfg["image"]
    assert image["model_args"]["depth"] == 2 and cfg["dataset"] == "digits" and image["augment"]["crop"] == "none"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["test_acc"] <= 1.0 and summary["parameters"] > 0
    for name in ("curves.png", "confusion.png", "explorer.html", "metrics.jsonl", "best.safetensors"):
        assert (run_dir / name).stat().st_size > 100, name


def test_eval_and_explain_never_replace_a_runs_own_files_without_overwrite(run_dir, capsys):
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert main(["eval", str(run_dir), "--out", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "training run's folder" in err and "confusion.png" in err and "--overwrite" in err
    assert main(["explain", str(run_dir), "--dataset", "digits", "--num", "2", "--importance-samples", "0",
                 "--out", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "explorer.html" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # nothing replaced


def test_eval_overwrites_a_runs_confusion_when_asked(run_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    old = (copy / "confusion.png").read_bytes()
    assert main(["eval", str(copy), "--out", str(copy), "--overwrite"]) == 0
    assert (copy / "confusion.png").read_bytes() != old and (copy / "eval.json").is_file()


def test_eval_prints_accuracy_and_writes_confusion(run_dir, tmp_path, capsys):
    assert main(["eval", str(run_dir), "--json", "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert out["dataset"] == "digits" and out["n"] == 359
    assert np.array(out["confusion"]).sum() == 359
    assert (tmp_path / "confusion.png").is_file()
    assert main(["eval", str(run_dir), "--json", "--flip"]) == 0
    flipped = json.loads(capsys.readouterr().out)
    assert flipped["flip"] is True and flipped["n"] == 359 and flipped["loss"] != out["loss"]
    # best.safetensors is what eval loads, and the preset (fmnist_quick) evaluates with eval_flip
    assert abs(flipped["accuracy"] - summary["best_test_acc"]) < 1e-9
    assert main(["eval", str(run_dir), "--json", "--flip", "--shift", "1"]) == 0
    ten = json.loads(capsys.readouterr().out)
    assert ten["shift"] == 1 and ten["n"] == 359 and ten["loss"] not in (out["loss"], flipped["loss"])


def test_predict_table_and_json(run_dir, tmp_path, capsys):
    from vitscope.data import load_dataset

    ds = load_dataset("digits", "test")
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(ds.images[i, 0].numpy()).save(folder / f"d{i}.png")
    assert main(["predict", str(run_dir), str(folder), "--top-k", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res) == 3 and all(len(r["top"]) == 2 for r in res)
    assert all(abs(sum(t["prob"] for t in r["top"])) <= 1.0001 for r in res)
    assert main(["predict", str(run_dir), str(folder / "d0.png")]) == 0
    assert "d0.png" in capsys.readouterr().out


def test_predict_skips_a_folders_unreadable_files_but_not_a_named_one(run_dir, tmp_path, capsys):
    from vitscope.data import load_dataset

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(load_dataset("digits", "test").images[0, 0].numpy()).save(folder / "good.png")
    (folder / "bad.png").write_bytes(b"not an image")
    (folder / "cut.png").write_bytes((folder / "good.png").read_bytes()[:40])  # a download cut short
    assert main(["predict", str(run_dir), str(folder), "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["file"] for r in json.loads(captured.out)] == [str(folder / "good.png")]
    assert "skipped: cannot read" in captured.err and "bad.png" in captured.err and "cut.png" in captured.err
    assert main(["predict", str(run_dir), str(folder / "bad.png")]) == 2
    assert "cannot read" in capsys.readouterr().err
    (folder / "good.png").unlink()
    assert main(["predict", str(run_dir), str(folder)]) == 2
    assert "no image could be read from the 2 files found" in capsys.readouterr().err


def test_eval_refuses_a_dataset_with_other_classes(run_dir, tmp_path, capsys):
    folder = tmp_path / "shapes"
    for split in ("train", "test"):
        for c in (f"c{i}" for i in range(10)):
            (folder / split / c).mkdir(parents=True)
            for i in range(2):
                Image.new("L", (8, 8), 40 * i).save(folder / split / c / f"{i}.png")
    assert main(["eval", str(run_dir), "--dataset", "folder", "--data-dir", str(folder)]) == 2
    err = capsys.readouterr().err
    assert ("the checkpoint's classes (0, 1, 2, 3, ... 10 in all, from digits) are not folder's "
            "(c0, c1, c2, c3, ... 10 in all)") in err


def test_eval_reads_a_folder_of_grayscale_images_as_the_model_does(run_dir, tmp_path, capsys):
    """A 1-channel model evaluated on an image folder: the files decode to one channel, not RGB."""
    from vitscope.data import load_dataset

    ds = load_dataset("digits", "test")
    root = tmp_path / "digit_pngs"
    for split in ("train", "test"):
        for i in range(40):
            label = int(ds.labels[i])
            (root / split / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(ds.images[i, 0].numpy()).save(root / split / str(label) / f"{i}.png")
    assert main(["eval", str(run_dir), "--dataset", "folder", "--data-dir", str(root), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 40
    import torch

    from vitscope.training.loop import evaluate
    from vitscope.weights.model_source import open_model

    model, info = open_model(run_dir)
    ds.images, ds.labels = ds.images[:40], ds.labels[:40]
    direct = evaluate(model, ds, info.mean, info.std, batch_size=40, device=torch.device("cpu"))
    assert res["accuracy"] == direct["acc"]  # the same pixels, read from PNG files


def test_explain_writes_explorer_and_pictures(run_dir, tmp_path, capsys):
    assert main(["explain", str(run_dir), "--dataset", "digits", "--num", "3", "--importance-samples", "64",
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "explorer.html").stat().st_size > 1000
    assert len(list(tmp_path.glob("*.png"))) >= 3


def test_resume_of_a_finished_run_needs_no_flags(run_dir, capsys):
    code = main(["train", "--resume", str(run_dir), "--epochs", "3"])
    assert code == 2
    assert "drop the other training flags" in capsys.readouterr().err


def test_models_and_data_list(capsys):
    assert main(["models", "vit_base*"]) == 0
    assert "86,567,656" in capsys.readouterr().out
    assert main(["data", "list"]) == 0
    assert "fashion_mnist" in capsys.readouterr().out


@pytest.mark.parametrize("argv, expected", [
    (["eval", "/no/such/run"], "no checkpoint at /no/such/run"),
    (["predict", "/no/such/run", "x.png"], "no checkpoint at /no/such/run"),
    (["train", "--set", "depthh=3", "--epochs", "1"], "not a model field"),
    (["train", "--set", "depth"], "--set takes FIELD=VALUE"),
    (["train", "--config", "/no/such.json"], "does not exist"),
    (["train", "--batch-size", "0"], "batch_size must be at least 1"),
    (["train", "--final-eval-shift", "-1"], "final_eval_shift is a number of pixels"),
    (["eval", "/no/such/run", "--shift", "-2"], "argument --shift: must be at least 0, got -2"),
    (["models", "nothing*"], "no preset matches"),
    (["train", "--betas", "0.9", "0.98", "0.999"], "betas are AdamW's two"),
    (["train", "--aug-rrc-scale", "0.5"], "rrc_scale is a range of two finite positive numbers"),
    (["train", "--aug-rrc-ratio", "1.3", "0.7"], "rrc_ratio is a range of two finite positive numbers"),
    (["train", "--threads", "-1"], "threads is a number of CPU threads"),
    (["train", "--dataset", "digits", "--set", "depth=abc"], "depth must be a whole number, got 'abc'"),
    (["train", "--dataset", "digits", "--set", "qkv_bias=1"], "qkv_bias must be true or false"),
    (["train", "--device", "gpu"], "device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
])
def test_user_errors_are_one_line_with_exit_code_2(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err and "Traceback" not in err


def test_a_run_that_cannot_start_leaves_no_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--dataset", "digits", "--model", "no_such_model", "--out", str(out)]) == 2
    assert "unknown model 'no_such_model'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_says_what_to_do(capsys):
    assert main(["train", "--dataset", "digits", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cpu" in err and "Traceback" not in err


def test_data_the_model_cannot_take(tmp_path, capsys):
    from vitscope.models import create_model
    from vitscope.weights.model_io import save_model

    ckpt = tmp_path / "rgb.safetensors"
    save_model(create_model("vit_tiny_patch4_28", in_chans=3, img_size=8, patch_size=2, depth=1), ckpt)
    assert main(["eval", str(ckpt), "--dataset", "digits"]) == 2
    err = capsys.readouterr().err.strip()
    assert "takes 3-channel images but the data has 1" in err and "\n" not in err


def test_missing_dataset_files_are_one_line(tmp_path, capsys, monkeypatch):
    import urllib.request

    def offline(*a, **k):
        raise OSError("network unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setenv("VITSCOPE_DATA", str(tmp_path / "cache"))
    assert main(["data", "verify", "mnist", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vitscope data: error:") and "\n" not in err


def test_argparse_errors_exit_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "vitscope", "train", "--amp", "fp64"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


def test_debug_shows_the_traceback():
    r = subprocess.run([sys.executable, "-m", "vitscope", "--debug", "eval", "/no/such/run"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_tuple_fields_take_space_separated_numbers_and_show_in_help(capsys):
    from vitscope.cli import build_parser, build_train_config

    args = build_parser().parse_args(["train", "--betas", "0.9", "0.98", "--aug-rrc-scale", "0.5", "1.0"])
    cfg = build_train_config(args)
    assert cfg.betas == (0.9, 0.98)
    assert cfg.image.augment.rrc_scale == (0.5, 1.0)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--betas X [X ...] AdamW's betas (default: 0.9 0.999)" in out


def test_every_train_flag_says_what_it_does_and_its_default():
    """Each field of TrainConfig and TrainTransform carries its help; `vitscope train --help` shows it with
    the value the flag's absence leaves: the fmnist_quick preset's, not the dataclass's."""
    import argparse
    import dataclasses

    from vitscope.cli.common import shown as _shown
    from vitscope.cli.main import build_parser
    from vitscope.data.transforms import TrainTransform
    from vitscope.training.loop import TrainConfig
    from vitscope.training.options import CaptionOptions, ImageOptions, TranslateOptions
    from vitscope.training.recipes import get_recipe

    for cls in (TrainConfig, TrainTransform, ImageOptions, CaptionOptions, TranslateOptions):
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), cls
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = {a.dest: a for a in sub.choices["train"]._actions}
    quick = get_recipe("fmnist_quick")
    assert quick.caption is None and quick.translate is None  # a classifier's: the options' own defaults show
    fields = [(f.name, getattr(quick, f.name)) for f in dataclasses.fields(TrainConfig)]
    fields += [(f.name, getattr(quick.image, f.name)) for f in dataclasses.fields(ImageOptions)]
    fields += [("aug_" + f.name, getattr(quick.image.augment, f.name)) for f in dataclasses.fields(TrainTransform)]
    options = {f.name: getattr(o, f.name) for o in (CaptionOptions(), TranslateOptions())
               for f in dataclasses.fields(o)}
    fields += options.items()
    flagged = [(dest, value) for dest, value in fields if dest in actions]
    # model_args (--set), augment (--aug-*), image, caption and translate (their fields' flags) have no flag of
    # their own
    assert len(flagged) == len(fields) - 5
    for dest, value in flagged:
        text = actions[dest].help
        assert text.endswith(f"(default: {_shown(value)})") and not text.startswith("default"), dest
        assert "%" not in text.replace("%%", ""), dest  # argparse would fail formatting it
    assert quick.epochs != TrainConfig().epochs
    assert actions["epochs"].help.endswith(f"(default: {quick.epochs})")
    assert actions["eval_flip"].help.endswith("(default: true)")
    assert actions["clip_grad"].help.endswith(f"(default: {quick.clip_grad})")
    assert actions["ema_decay"].help.endswith("(default: none)")
    assert actions["aug_crop"].help.endswith(f"(default: {quick.image.augment.crop})")


def test_every_option_of_every_command_has_help():
    import argparse

    from vitscope.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings[-1]}" for name, p in sub.choices.items() for a in p._actions
               if a.option_strings and not a.help]
    assert not missing, missing


def test_vitscopes_own_warnings_are_one_plain_line(monkeypatch):
    import warnings

    import vitscope.data.folder as folder
    from vitscope.cli.main import _plain_warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    _plain_warnings("vitscope eval")
    _plain_warnings("vitscope train")  # a second main() in one process replaces the first, not wraps it
    assert warnings.formatwarning("skipped 1 file", UserWarning, folder.__file__, 9) == (
        "vitscope train: warning: skipped 1 file\n")
    assert "other.py:9: UserWarning: theirs" in warnings.formatwarning("theirs", UserWarning, "/x/other.py", 9)


def test_eval_of_a_folder_run_reads_the_runs_folder_and_split(tmp_path, capsys):
    """A run trained on an image folder evaluated with no flags: the folder and split it evaluated on."""
    root = tmp_path / "photos"
    for c, level in (("dark", 30), ("light", 220)):
        (root / c).mkdir(parents=True)
        for i in range(20):
            Image.new("RGB", (8, 8), (level + i, level, level)).save(root / c / f"{i}.png")
    out = tmp_path / "run"
    flags = " ".join(TINY).replace("--dataset digits", "--dataset folder").replace("--batch-size 64", "--batch-size 8")
    assert main(["train", *flags.split(), "--data-dir", str(root), "--eval-split", "val", "--epochs", "1",
                 "--explain-images", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["dataset"] == "folder" and res["split"] == "val" and res["n"] == 4  # 10% of each class held out
    assert main(["explain", str(out), "--dataset", "folder", "--split", "val", "--num", "2", "--no-report",
                 "--importance-samples", "0", "--out", str(tmp_path / "ex")]) == 0
    page = (tmp_path / "ex" / "explorer.html").read_text()
    assert 'id="over-training"' in page and '"steps":[0,' in page  # explaining a run: its probes' slider


def test_the_library_presets_name_no_run_folder():
    """A preset that starts from another preset's trained weights names that preset; the folder `make run` leaves
    them in is the command line's to resolve, so the library's configs hold no path of the Makefile's."""
    from vitscope.cli import build_parser, build_train_config
    from vitscope.training.recipes import STARTS_FROM, get_recipe, list_recipes

    assert all(get_recipe(name).image is None or get_recipe(name).image.init_weights is None
               for name in list_recipes())
    assert set(STARTS_FROM) <= set(list_recipes()) and set(STARTS_FROM.values()) <= set(list_recipes())
    cfg = build_train_config(build_parser().parse_args(["train", "--preset", "caption_lstm_quick"]))
    assert cfg.image.init_weights == "runs/fmnist_quick/best.safetensors"


def test_a_resume_whose_config_was_edited_names_the_fields_and_refuses(tmp_path, capsys):
    from vitscope.cli import build_parser, build_train_config
    from vitscope.training.loop import train

    part = tmp_path / "part"  # a run stopped after 3 steps, its checkpoint committed
    train(build_train_config(build_parser().parse_args(["train", *TINY])), part, progress=False, max_steps=3)
    edited = json.loads((part / "config.json").read_text())
    edited["lr"] *= 10
    (part / "config.json").write_text(json.dumps(edited))
    before = (part / "checkpoint.json").read_text()
    assert main(["train", "--resume", str(part)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "in lr;" in err and "--config-changes" in err, err
    assert (part / "checkpoint.json").read_text() == before
    assert main(["train", "--resume", str(part), "--config-changes"]) == 0  # asked for: it continues


def test_a_flag_that_does_nothing_says_so(tmp_path, capsys):
    # digits ships with scikit-learn: a data folder is not read, and one warning line says so
    with pytest.warns(UserWarning, match="'digits' reads no files of its own") as caught:
        assert main(["train", *TINY, "--epochs", "1", "--data-dir", str(tmp_path / "nowhere"),
                     "--out", str(tmp_path / "run")]) == 0
    assert len({str(w.message) for w in caught}) == 1
    # a captioner's encoder is built at the size the images are read at: a second size is refused, not ignored
    assert main(["train", "--task", "caption", "--init-weights", "none", "--set", "img_size=28",
                 "--out", str(tmp_path / "cap")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--image-size" in err and "img_size=28" in err, err
    assert not (tmp_path / "cap").exists()
    assert main(["train", *TINY, "--image-size", "16", "--set", "img_size=12", "--out", str(tmp_path / "r2")]) == 2
    assert "beside --image-size 16" in capsys.readouterr().err


def test_a_caption_dataset_without_the_caption_task_says_how(tmp_path, capsys):
    assert main(["train", "--dataset", "flickr8k", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "captioning dataset" in err and "--task caption" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("command", [["models"], ["train", "--dataset", "digits"], ["data", "list"]])
def test_an_instruction_set_cap_that_names_none_is_refused_by_every_command(command, monkeypatch, capsys):
    monkeypatch.setenv("VITSCOPE_ISA", "bogus")
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "VITSCOPE_ISA='bogus'" in err and "avx2" in err, err


def test_a_channel_count_the_images_do_not_have_is_one_line_before_any_work(tmp_path, capsys):
    assert main(["train", *TINY, "--set", "in_chans=2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "in_chans=2" in err and "1 channel" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("count", ["3", "0", "-1"])
def test_a_class_count_the_data_does_not_have_is_one_line_before_any_work(count, tmp_path, capsys):
    assert main(["train", *TINY, "--set", f"num_classes={count}", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"num_classes={count}" in err and "10 classes" in err, err
    assert not (tmp_path / "r").exists()


def test_init_weights_of_another_token_layout_say_so_not_an_api_hint(tmp_path, capsys):
    first = tmp_path / "cls"
    assert main(["train", "--model", "vit_tiny_patch4_28", "--dataset", "digits", "--epochs", "1", "--set",
                 "embed_dim=16", "--set", "depth=1", "--set", "num_heads=2", "--explain-images", "0",
                 "--threads", "1", "--no-progress", "--out", str(first)]) == 0
    capsys.readouterr()
    assert main(["train", "--model", "vit_tiny_patch4_28", "--dataset", "digits", "--epochs", "1", "--set",
                 "embed_dim=16", "--set", "depth=1", "--set", "num_heads=2", "--set", "class_token=false",
                 "--set", 'global_pool="avg"', "--init-weights", str(first / "best.safetensors"),
                 "--out", str(tmp_path / "gap")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "1 class token before a 2 x 2 grid" in err and "--init-weights none" in err and "old_size" not in err, err
