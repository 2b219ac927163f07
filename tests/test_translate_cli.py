"""The translation commands on a tiny run: `vitscope train --task translate` writes its report (alignment heatmap,
explorer page, summary), `vitscope eval RUN` scores it, `vitscope translate RUN SENTENCE` translates, and bad
input (an unknown word, an empty sentence, a run that is not a translator's, a wrong config field) is one line
with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from test_explorer_over_training import page_data, unhalf
from vitscope.cli import main
from vitscope.inspect.probes import read_probes
from vitscope.translate.language import LEXICON
from vitscope.translate.run import open_translator

TINY = ["--task", "translate", "--train-sentences", "400", "--test-sentences", "20", "--max-words", "10",
        "--epochs", "2", "--batch-size", "32", "--eval-every-steps", "0", "--threads", "1", "--explain-images", "3",
        "--decoder-set", "embed_dim=24", "--decoder-set", "hidden_dim=24", "--decoder-set", "attn_dim=24",
        "--no-progress"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("translate") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def test_train_writes_the_report(run):
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "translate" and summary["description"] == "RNN with attention"
    assert 0 <= summary["test_exact_match"] <= 1 and len(summary["examples"]) == 8
    # every word of the lexicon on each side, and the 4 specials ("mi" is the translation of two verbs)
    assert summary["vocabulary"] == {"source": len(LEXICON) + 4, "target": 63}
    with Image.open(run / "alignment.png") as im:
        assert im.size[0] > 300 and im.size[1] > 300
    page = (run / "translations.html").read_text()
    data = json.loads(page.split('<script id="vitscope-data" type="application/json">')[1].split("</script>")[0])
    assert len(data["sentences"]) == 3 and data["num_layers"] == data["num_heads"] == 1
    assert "currentRow" in page


def test_train_keeps_the_alignment_of_four_test_sentences_over_training(run):
    probes = read_probes(run)
    assert probes.kind == "translate" and probes.steps[0] == 0 and len(probes.steps) == 3  # before, 2 epochs
    assert len(probes.inputs) == 4
    item, att = probes.inputs[0], probes.attention(probes.steps[-1])[0]
    assert att.shape[0] >= len(item["target"]) and att.shape[1] >= len(item["source"])
    # each target word's attention is a distribution over the source words (pads get none)
    torch.testing.assert_close(att[: len(item["target"]), : len(item["source"])].sum(-1),
                               torch.ones(len(item["target"])), atol=2e-3, rtol=0)
    assert (run / "probes.png").is_file() and not (run / "probes.html").exists()
    # translations.html carries them under "Over training": one slider entry per step, the alignment as kept
    over = page_data((run / "translations.html").read_text())["probes"]
    assert over["kind"] == "translate" and over["steps"] == probes.steps
    for s, frame in zip(probes.steps, over["frames"]):
        torch.testing.assert_close(unhalf(frame), probes.attention(s), atol=1e-3, rtol=1e-3)  # (K, T, N), RNN


def test_eval_scores_the_test_sentences(run, capsys):
    capsys.readouterr()
    assert main(["eval", str(run), "--beam", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sentences"] == 20 and set(out["decoding"]) == {"greedy", "beam 3"}
    summary = json.loads((run / "summary.json").read_text())
    assert out["decoding"]["greedy"]["exact_match"] == pytest.approx(summary["test"]["exact_match"])
    assert 0 <= out["decoding"]["greedy"]["alignment"] <= 1


def test_translate_prints_the_translation_and_where_each_word_looked(run, capsys):
    capsys.readouterr()
    assert main(["translate", str(run), "The dog sees a cat.", "--beam", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["source"] == "the dog sees a cat"
    assert len(rows[0]["looked_at"]) == len(rows[0]["words"])
    assert all(w in rows[0]["source"].split() for w in rows[0]["looked_at"])
    translator = open_translator(run)
    again = translator.translate([["the", "dog", "sees", "a", "cat"]], beam=2)[0]
    assert again.words == rows[0]["words"]


@pytest.mark.parametrize("sentence, message", [
    ("the dgo sees a cat", "unknown word 'dgo'"),
    ("", "the sentence is empty"),
    ("the dog " * 8, "at most 10"),
])
def test_bad_sentences_are_one_line_and_exit_2(run, capsys, sentence, message):
    capsys.readouterr()
    assert main(["translate", str(run), sentence]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and err.startswith("vitscope translate: error:")


def test_a_run_that_is_not_a_translator_is_refused(tmp_path, capsys):
    assert main(["translate", str(tmp_path), "the dog sees a cat"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a translation run" in err


def test_a_translator_with_nan_weights_is_refused(run, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    from vitscope.weights.model_io import read_metadata

    broken = tmp_path / "run"
    shutil.copytree(run, broken)
    for ckpt in broken.glob("*.safetensors"):  # whichever the run's checkpoint is
        state, meta = load_file(str(ckpt)), read_metadata(ckpt)
        name = next(n for n, t in state.items() if t.is_floating_point())
        state[name].view(-1)[0] = float("nan")
        ckpt.unlink()  # a hard link to the committed weights: not written through
        save_file(state, str(ckpt), metadata=meta)
    assert main(["translate", str(broken), "the dog sees a cat"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds NaN or infinite weights" in err


@pytest.mark.parametrize("flags, message", [
    (["--decoder-set", "depth=2"], "not a field of the rnn translator"),
    (["--max-words", "2"], "max_words must be from 3"),
    (["--dataset", "fashion_mnist"], "trains on the synthetic language pair"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    assert main(["train", "--task", "translate", *flags, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
