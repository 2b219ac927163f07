"""The caption commands on a tiny run: `vitscope train --task caption`, `vitscope eval RUN` (greedy and beam,
BLEU/CIDEr-D and the grounded measures), `vitscope caption RUN IMAGES` (lines and JSON), and every bad input
the issue lists as one line with exit code 2 that leaves the run as it was."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from test_caption_models import one_thread  # noqa: F401 (autouse)
from test_caption_train import toy_scenes
from test_explorer_over_training import page_data, unhalf
from vitscope.caption import builders as caption_task
from vitscope.cli import main
from vitscope.inspect.probes import read_probes

TINY = ["--task", "caption", "--model", "vit_tiny_patch7_28", "--set", "depth=1", "--set", "embed_dim=32",
        "--set", "num_heads=2", "--decoder-set", "dim=32", "--decoder-set", "depth=1", "--decoder-set", "num_heads=2",
        "--dataset", "fmnist_scenes", "--epochs", "4", "--batch-size", "8", "--eval-batch-size", "16",
        "--lr", "3e-3", "--amp", "fp32", "--threads", "1", "--max-len", "40", "--explain-images", "2",
        "--no-progress"]


@pytest.fixture(scope="module")
def toy_data():
    with pytest.MonkeyPatch.context() as mp:
        real = caption_task.load_caption_dataset

        def load(name, split, **kw):
            if name == "fmnist_scenes" and split in ("train", "test"):
                return toy_scenes(split, 96 if split == "train" else 12)
            return real(name, split, **kw)

        mp.setattr(caption_task, "load_caption_dataset", load)
        yield


@pytest.fixture(scope="module")
def run_dir(toy_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("caption") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def snapshot(folder: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def one_line_error(capsys, code, *fragments):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("vitscope "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err
    return err


def test_train_writes_a_caption_run(run_dir):
    for name in ("best.safetensors", "curves.png", "caption_attention.png", "captions.html", "summary.json"):
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "config.json").read_text())["task"] == "caption"
    # captions.html carries the run's probes under "Over training": one slider entry per kept step, each the
    # probed scenes' cross-attention over the patches at every layer and head, as probes.safetensors holds it
    probes = read_probes(run_dir)
    over = page_data((run_dir / "captions.html").read_text())["probes"]
    assert over["kind"] == "caption" and over["steps"] == probes.steps and len(probes.steps) >= 2
    for s, frame in zip(probes.steps, over["frames"]):
        att = probes.attention(s)  # (K, T, L, H, N)
        want = att[..., probes.num_prefix_tokens:] if att.ndim == 5 else att
        torch.testing.assert_close(unhalf(frame), want, atol=1e-3, rtol=1e-3)


def test_eval_reports_greedy_and_beam(run_dir, capsys):
    assert main(["eval", str(run_dir), "--beam", "3"]) == 0
    out = capsys.readouterr().out
    assert "BLEU-4" in out and "CIDEr-D" in out and "grounding" in out
    lines = out.splitlines()
    assert any(line.startswith("greedy") for line in lines) and any(line.startswith("beam 3") for line in lines)
    assert main(["eval", str(run_dir), "--beam", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    greedy, beam = summary["decoding"]["greedy"], summary["decoding"]["beam 3"]
    assert summary["images"] == 12 and greedy["beam"] == 1 and beam["beam"] == 3
    for m in (greedy, beam):
        assert 0 <= m["bleu4"] <= m["bleu1"] <= 1 and m["cider"] >= 0 and 0 <= m["item_accuracy"] <= 1
    # the run's own figure for its best evaluation, whose weights best.safetensors holds
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["test_item_accuracy"] for r in rows) == pytest.approx(greedy["item_accuracy"])


def test_eval_under_bfloat16_autocast_gives_the_loops_figure(run_dir, capsys):
    """`--amp bf16` evaluates as the loop evaluates a run that trains in bfloat16: the same decoding, under
    autocast, so its numbers are the API's with bf16=True."""
    from vitscope.caption.evaluate import evaluate_captions
    from vitscope.caption.run import open_captioner

    assert main(["eval", str(run_dir), "--beam", "1", "--json", "--amp", "bf16"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["amp"] == "bf16"
    run = open_captioner(run_dir, kernels=True)
    data = caption_task.load_caption_dataset(run.dataset, "test", image_size=run.image_size[0], channels=run.channels)
    expected = evaluate_captions(run.model.eval(), data, run.vocab, mean=run.mean, std=run.std, beam=1,
                                 batch_size=500, bf16=True).metrics
    got = summary["decoding"]["greedy"]
    for key in ("bleu1", "bleu4", "cider", "item_accuracy", "grounding"):
        assert got[key] == pytest.approx(expected[key], abs=1e-12), key


def test_caption_prints_captions_for_files_and_folders(run_dir, tmp_path, capsys):
    folder = tmp_path / "scenes"
    folder.mkdir()
    data = toy_scenes("test", 3)
    for i in range(3):
        Image.fromarray(data.images[i, 0].numpy()).save(folder / f"scene{i}.png")
    assert main(["caption", str(run_dir), str(folder), "--beam", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [Path(r["file"]).name for r in rows] == ["scene0.png", "scene1.png", "scene2.png"]
    assert all(r["caption"] and r["words"] and r["score"] <= 0 for r in rows)
    assert main(["caption", str(run_dir), str(folder / "scene1.png"), "--beam", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(rows[1]["caption"])  # the same image, the same caption


def test_caption_reads_the_checkpoints_header_once(run_dir, tmp_path, monkeypatch, capsys):
    """`vitscope caption RUN img` asks what the checkpoint is, then opens it: one read of its header."""
    from vitscope.weights import model_io as checkpoints

    image = tmp_path / "scene.png"
    Image.fromarray(toy_scenes("test", 1).images[0, 0].numpy()).save(image)
    opened, real = [], checkpoints.safe_open
    monkeypatch.setattr(checkpoints, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    checkpoints._read_metadata.cache_clear()
    assert main(["caption", str(run_dir), str(image)]) == 0
    assert opened == [str(run_dir / "best.safetensors")]


def _coco(tmp_path: Path, captions: list[dict], files=("a.png",)) -> Path:
    (tmp_path / "images").mkdir(exist_ok=True)
    for f in files:
        Image.fromarray(np.full((8, 8, 3), 100, np.uint8)).save(tmp_path / "images" / f)
    images = [{"id": i, "file_name": f} for i, f in enumerate(("a.png", "b.png"))]
    path = tmp_path / "captions.json"
    path.write_text(json.dumps({"images": images, "annotations": captions}))
    return path


@pytest.mark.parametrize("case", ["missing image", "empty caption"])
def test_a_bad_caption_file_is_one_line_and_no_run_directory(tmp_path, capsys, case):
    anns = [{"image_id": 0, "caption": "a grey square"}, {"image_id": 1, "caption": "another grey square"}]
    if case == "empty caption":
        anns[1]["caption"] = "  "
    path = _coco(tmp_path, anns, files=("a.png",) if case == "missing image" else ("a.png", "b.png"))
    out = tmp_path / "run"
    code = main(["train", "--task", "caption", "--dataset", "coco", "--data-dir", str(tmp_path / "images"),
                 "--captions-file", str(path), "--model", "vit_tiny_patch7_28", "--image-size", "28",
                 "--batch-size", "1", "--out", str(out), "--no-progress"])
    one_line_error(capsys, code, "b.png" if case == "missing image" else "empty caption")
    assert not out.exists()


def test_bad_inputs_to_eval_and_caption_are_one_line_and_lose_nothing(run_dir, tmp_path, capsys):
    before = snapshot(run_dir)
    image = tmp_path / "scene.png"
    Image.fromarray(toy_scenes("test", 1).images[0, 0].numpy()).save(image)
    one_line_error(capsys, main(["eval", str(run_dir), "--split", "valid"]), "valid")  # an unknown split
    other = tmp_path / "vocab.json"
    other.write_text(json.dumps({"format": "vitscope.caption.vocab/1",
                                 "words": ["<pad>", "<bos>", "<eos>", "<unk>", "cat", "dog"]}))
    one_line_error(capsys, main(["caption", str(run_dir), str(image), "--vocab", str(other)]),
                   "vocabulary has 6 words")
    one_line_error(capsys, main(["caption", str(run_dir), str(image), "--beam", "0"]), "--beam", "at least 1")
    one_line_error(capsys, main(["caption", str(run_dir), str(image), "--max-len", "999"]), "999", "40 positions")
    one_line_error(capsys, main(["eval", str(run_dir), "--max-len", "41"]), "41")
    for penalty in ("nan", "inf"):  # a score of NaN is not JSON, and ranks nothing
        one_line_error(capsys, main(["caption", str(run_dir), str(image), "--length-penalty", penalty, "--json"]),
                       "length penalty", "finite")
    one_line_error(capsys, main(["train", *TINY, "--eval-split", "valid", "--out", str(tmp_path / "r2")]), "valid")
    assert not (tmp_path / "r2").exists()
    one_line_error(capsys, main(["train", *TINY, "--aug-flip", "true", "--out", str(tmp_path / "r3")]), "flip")
    assert snapshot(run_dir) == before  # nothing written, nothing removed


def test_the_caption_preset_without_the_readme_classifier_says_to_run_it_first(toy_data, tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/fmnist_quick here
    code = main(["train", "--preset", "caption_quick", "--out", "cap", "--no-progress"])
    one_line_error(capsys, code, "runs/fmnist_quick/best.safetensors", "make run", "--init-weights none")
    assert not (tmp_path / "cap").exists()


def test_init_weights_none_and_another_encoder_drop_the_presets_starting_weights():
    from vitscope.cli import build_parser, build_train_config

    preset = "runs/fmnist_quick/best.safetensors"
    for flags, want in ((["--init-weights", "none"], None), (["--model", "vit_tiny_patch7_28"], None),
                        (["--model", "vit_tiny_patch7_28", "--init-weights", "w.safetensors"], "w.safetensors"),
                        ([], preset), (["--clip-grad", "none"], preset)):
        cfg = build_train_config(build_parser().parse_args(["train", "--preset", "caption_quick", *flags]))
        assert cfg.image.init_weights == want, flags
    assert cfg.clip_grad is None  # `--flag none` overrides a preset's value (it used to read as not given)


@pytest.mark.parametrize("setting,words", [
    ("dim=-5", ["dim", "at least 1", "-5"]), ("num_heads=0", ["num_heads", "at least 1"]),
    ("dim=abc", ["dim", "whole number", "abc"]), ("mlp_ratio=NaN", ["mlp_ratio", "finite"]),
    ("depth=0", ["depth", "at least 1"]), ("memory_pos=maybe", ["memory_pos", "true or false", "maybe"]),
    ("drop=1.5", ["drop", "[0, 1)"]), ("dim=102", ["dim (102)", "num_heads (4)"]),
])
def test_decoder_fields_are_checked_by_type_and_range_before_any_work(tmp_path, capsys, setting, words):
    out = tmp_path / "run"
    code = main(["train", "--task", "caption", "--init-weights", "none", "--decoder-set", setting, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and all(w in err for w in words), err
    assert not out.exists()  # refused before the folder was made: the same --out works once corrected


def test_predict_and_explain_given_a_captioning_run_say_what_it_is(run_dir, tmp_path, capsys):
    image = tmp_path / "scene.png"
    Image.fromarray(toy_scenes("test", 1).images[0, 0].numpy()).save(image)
    one_line_error(capsys, main(["predict", str(run_dir), str(image)]), "is a captioning run", "vitscope caption")
    one_line_error(capsys, main(["explain", str(run_dir), str(image), "--out", str(tmp_path / "x")]),
                   "is a captioning run", "vitscope caption")


def test_another_captioner_than_the_presets_drops_the_presets_decoder_fields():
    from vitscope.cli import build_parser, build_train_config

    cfg = build_train_config(build_parser().parse_args(["train", "--task", "caption", "--captioner", "lstm",
                                                        "--init-weights", "none", "--decoder-set", "hidden_dim=64"]))
    cfg.validate()  # the transformer preset's dim, depth and heads are not handed to the LSTM
    assert cfg.caption.captioner == "lstm" and cfg.caption.decoder_args == {"hidden_dim": 64}
