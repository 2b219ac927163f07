"""Each task owns its options: TrainConfig.image (the image tasks': classify and caption) and TrainConfig.caption /
.translate (training/options.py) hold the fields only those tasks read. A run written before they were nested (a
flat config.json, a state file's `best_acc`) still loads and resumes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

from test_train import tiny_config, weights
from vitscope.errors import ConfigError
from vitscope.training.checkpointing import MANIFEST
from vitscope.training.loop import TrainConfig, train
from vitscope.training.options import CaptionOptions, ImageOptions, TranslateOptions, nest_task_options
from vitscope.training.progress import Progress
from vitscope.training.recipes import get_recipe
from vitscope.training.task import check_unused

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("preset", ["fmnist_quick", "caption_quick", "translate_transformer"])
def test_a_flat_config_json_from_before_loads_to_the_same_config(preset):
    flat = json.loads((FIXTURES / f"flat_config_{preset}.json").read_text())
    assert "max_len" in flat and "train_sentences" in flat  # as written then: every task's fields at the top
    cfg = TrainConfig.from_dict(flat)
    assert cfg == get_recipe(preset)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # and as written now


@pytest.mark.parametrize("preset", ["fmnist_best", "caption_quick", "translate_rnn"])
def test_a_config_json_with_the_image_options_at_the_top_loads_to_the_same_config(preset):
    flat = json.loads((FIXTURES / f"image_flat_config_{preset}.json").read_text())
    assert "model" in flat and "augment" in flat and "image" not in flat  # as written then: the task options nested
    cfg = TrainConfig.from_dict(flat)
    assert cfg == get_recipe(preset)
    assert (cfg.image is None) == (preset == "translate_rnn")
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_trainconfig_holds_each_tasks_options_apart():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    # 45 flat fields at first: 10 task options moved (caption and translate added), then 9 image options (image)
    assert len(names) == 29
    assert not names & ({f.name for f in dataclasses.fields(CaptionOptions)}
                        | {f.name for f in dataclasses.fields(TranslateOptions)}
                        | {f.name for f in dataclasses.fields(ImageOptions)})
    assert TrainConfig().caption is None and TrainConfig().translate is None
    assert TrainConfig().image == ImageOptions() and get_recipe("caption_quick").image.model == "vit_fmnist_quick"
    assert get_recipe("translate_rnn").image is None  # a translation reads no images
    caption = get_recipe("caption_quick")
    assert caption.translate is None and caption.options() is caption.caption and caption.caption.max_len == 40
    translate = get_recipe("translate_rnn")
    assert translate.caption is None and translate.options().translator == "rnn"
    # another task's options left at their defaults are not kept: nothing in the config a run does not read
    assert dataclasses.replace(caption, task="classify", dataset="digits", caption=CaptionOptions()).caption is None


def test_a_flat_classify_config_keeps_another_tasks_setting_so_it_is_refused():
    nested = nest_task_options({"task": "classify", "max_len": 12, "eval_beam": 3, "train_sentences": 20_000})
    assert nested == {"task": "classify", "caption": {"max_len": 12, "eval_beam": 3}}


def test_a_flat_translate_config_keeps_an_image_setting_so_it_is_refused():
    flat = json.loads((FIXTURES / "image_flat_config_translate_rnn.json").read_text())
    cfg = TrainConfig.from_dict({**flat, "model": "vit_tiny_patch4_28", "eval_flip": True})
    assert cfg.image == ImageOptions(model="vit_tiny_patch4_28", eval_flip=True)
    with pytest.raises(ConfigError) as e:
        check_unused(cfg)
    assert str(e.value) == ("--task translate: --model, --eval-flip would be ignored: a translator reads no such "
                            "setting (it reads sentences, not images); drop them")


@pytest.mark.parametrize("flags, named", [
    (["--model", "vit_tiny_patch4_28"], "--model"), (["--set", "depth=1"], "--set depth"),
    (["--aug-crop", "rrc"], "--aug-crop"), (["--image-size", "32"], "--image-size"),
    (["--init-weights", "w.safetensors"], "--init-weights"), (["--eval-flip", "true"], "--eval-flip"),
    (["--data-dir", "data"], "--data-dir"), (["--pretrained", "true"], "--pretrained"),
])
def test_the_image_options_are_refused_by_a_translation_in_one_line(flags, named, capsys):
    from vitscope.cli import main

    assert main(["train", "--task", "translate", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--task translate: {named} would be ignored" in err
    assert "reads sentences, not images" in err, err


def test_resume_names_a_changed_image_option(tmp_path):
    from vitscope.training.resume import changed_since, config_by_name, find_checkpoint

    # a checkpoint's train_config from before the image options were nested compares as the same config
    flat = json.loads((FIXTURES / "image_flat_config_fmnist_best.json").read_text())
    now = json.loads(json.dumps(get_recipe("fmnist_best").to_dict()))
    assert config_by_name(nest_task_options(flat)) == config_by_name(now)
    assert "image.final_eval_shift" in config_by_name(now)
    cfg = tiny_config(epochs=1)
    train(cfg, tmp_path, progress=False, max_steps=2)
    found = find_checkpoint(tmp_path)
    changed = dataclasses.replace(cfg, image=dataclasses.replace(cfg.image, eval_flip=True))
    assert changed_since(found, changed) == ["image.eval_flip"]
    assert changed_since(found, cfg) == []


@pytest.mark.parametrize("options,said", [
    (CaptionOptions(decoder_args={"hidden_dim": 8}), "hidden_dim not a field of the transformer captioner"),
    (CaptionOptions(decoder_args={"dim": "wide"}), "decoder field dim must be a whole number, got 'wide'"),
    (CaptionOptions(decoder_args={"dim": 10, "num_heads": 3}), "decoder field dim (10) must divide into num_heads"),
    (CaptionOptions(captioner="lstm", decoder_args={"drop": 1.5}), "decoder field drop must be in [0, 1)"),
    (TranslateOptions(decoder_args={"depth": 2}), "depth not a field of the rnn translator"),
    (TranslateOptions(translator="transformer", decoder_args={"mlp_ratio": 0}),
     "decoder field mlp_ratio must be a finite number above 0"),
])
def test_decoder_settings_are_checked_by_the_decoders_own_config(options, said):
    with pytest.raises(ConfigError) as e:
        options.validate()
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def _make_old(run: Path) -> None:
    """Rewrite `run` as vitscope wrote it before the options were nested: a flat config.json, `best_acc`."""
    cfg = json.loads((run / "config.json").read_text())
    flat = {k: v for k, v in cfg.items() if k not in ("image", "caption", "translate")}
    flat |= cfg["image"] | dataclasses.asdict(CaptionOptions()) | dataclasses.asdict(TranslateOptions())
    (run / "config.json").write_text(json.dumps(flat, indent=2))
    manifest = json.loads((run / MANIFEST).read_text())
    state_file = run / manifest["files"]["state"]
    state = torch.load(state_file, weights_only=False)
    state["best_acc"] = state.pop("best_metric")
    torch.save(state, state_file)
    manifest["sha256"][state_file.name] = hashlib.sha256(state_file.read_bytes()).hexdigest()
    manifest.setdefault("bytes", {})[state_file.name] = state_file.stat().st_size
    (run / MANIFEST).write_text(json.dumps(manifest, indent=2))


def test_a_run_from_before_resumes_bit_identically(tmp_path):
    cfg = tiny_config(epochs=2)
    whole = train(cfg, tmp_path / "whole", progress=False)
    train(cfg, tmp_path / "old", progress=False, max_steps=5)
    _make_old(tmp_path / "old")
    assert "best_acc" in torch.load(next((tmp_path / "old").glob("step-*.state.pt")), weights_only=False)
    old = TrainConfig.from_dict(json.loads((tmp_path / "old" / "config.json").read_text()))
    assert old == cfg
    resumed = train(old, tmp_path / "old", resume=True, progress=False)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "old")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.best == whole.best


def test_progress_reads_a_state_that_names_its_best_metric_best_acc():
    new = Progress(step=3, best_metric=0.75, train_time_s=1.0, seen=12).to_state()
    assert "best_acc" not in new
    old = {**{k: v for k, v in new.items() if k != "best_metric"}, "best_acc": 0.75}
    assert Progress.from_state(old) == Progress.from_state(new)


@pytest.mark.parametrize("saved", [{"image": {"data_dir": "/data"}}, {"data_dir": "/data"}])
def test_eval_reads_the_runs_data_dir_from_a_checkpoint_new_or_old(saved, monkeypatch):
    """`vitscope eval` / `explain` read a run's files where the checkpoint's train_config says, nested or flat."""
    from types import SimpleNamespace

    from test_train import TINY
    from vitscope.models import create_model
    from vitscope.weights import model_source

    seen = {}
    monkeypatch.setattr(model_source, "load_dataset", lambda name, split, root=None, **kw: seen.update(root=root))
    model = create_model("vit_tiny_patch4_28", **TINY)
    info = SimpleNamespace(train_config={"dataset": "digits", **saved}, dataset="digits")
    model_source.load_data(model, info, "digits")
    assert seen["root"] == "/data"
