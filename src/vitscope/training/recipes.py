"""Training recipes: a named TrainConfig with the command to run it and what to expect.

Each docstring gives the command, the time on the stated machine and the measured result; the
figures and the scripts that measured them are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Callable

from vitscope.data.transforms import TrainTransform
from vitscope.errors import ConfigError
from vitscope.training.loop import TrainConfig
from vitscope.training.options import CaptionOptions, ImageOptions, TranslateOptions

_RECIPES: dict[str, Callable[[], TrainConfig]] = {}


def recipe(fn: Callable[[], TrainConfig]) -> Callable[[], TrainConfig]:
    _RECIPES[fn.__name__] = fn
    return fn


def list_recipes() -> list[str]:
    return sorted(_RECIPES)


# A preset whose model starts from another preset's trained weights: the run folder holding them is the
# caller's to find (the CLI reads the one `make run` writes), so the library names the preset, not a path.
STARTS_FROM = {"caption_quick": "fmnist_quick", "caption_lstm_quick": "fmnist_quick", "caption_lstm": "fmnist_quick"}


def get_recipe(name: str) -> TrainConfig:
    if name not in _RECIPES:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(list_recipes())}")
    return _RECIPES[name]()


def recipe_doc(name: str) -> str:
    return (_RECIPES[name].__doc__ or "").strip().splitlines()[0]


@recipe
def fmnist_quick() -> TrainConfig:
    """Fashion-MNIST in minutes on 2 CPU cores: the README's main job (`make run`).

    `vitscope train --preset fmnist_quick` -> about 93.7% test accuracy (each image averaged with its mirror):
    93.86% / 93.71% (seeds 0, 1) in about 5 minutes on a 2-core Xeon with AMX, 93.6-93.7% in 6-8 on a Zen 4
    EPYC (bfloat16), 93.70% in 19-22 on a Zen 3 EPYC (float32). Evidence and commands: benchmarks/RESULTS.md.
    Why this recipe: a five-conv stem to 7 x 7 tokens and 2 blocks (models.vit_fmnist_quick), Muon on the hidden
    matrices (ahead of AdamW by about a point at this length), flips only (crops and erasing cost accuracy in
    so few epochs), seven epochs.
    """
    return TrainConfig(optimizer="muon", epochs=7, batch_size=128, lr=1.5e-3, weight_decay=0.05, warmup_epochs=0.3,
                       label_smoothing=0.1, image=ImageOptions(model="vit_fmnist_quick", eval_flip=True,
                                                               augment=TrainTransform(crop="none", flip=True)))


@recipe
def fmnist_best() -> TrainConfig:
    """Fashion-MNIST, the accuracy preset: under an hour on 2 CPU cores.

    `vitscope train --preset fmnist_best` -> about 95.1% with 10 test views (95.01% / 95.16% for seeds 0, 1) in
    28-31 minutes on a 2-core Xeon with AMX, 39-41 on a Zen 4 EPYC. Evidence and commands:
    benchmarks/RESULTS.md. Why this recipe: the quick preset's model for 46 epochs with Muon, which many epochs
    let regularise (pad-2 crops, flips, random erasing, CutMix on half the batches); a deeper model lost to the
    faster step's extra epochs. Each epoch is evaluated on every image and its mirror; the final evaluation
    also on each moved one pixel each way (`final_eval_shift`, 10 views).
    """
    return TrainConfig(optimizer="muon", epochs=46, batch_size=128, lr=1.5e-3, weight_decay=0.05, warmup_epochs=1,
                       label_smoothing=0.1, ema_decay=None, image=ImageOptions(
                           model="vit_fmnist_quick", eval_flip=True, final_eval_shift=1,
                           augment=TrainTransform(crop="pad", pad=2, flip=True, erase_p=0.25, cutmix_alpha=1.0,
                                                  mix_prob=0.5)))


@recipe
def fmnist_tutorial() -> TrainConfig:
    """The tutorials' ViT and recipe on Fashion-MNIST, for comparison: width 32, 2 heads, 6 layers,
    patch 4, Adam (no weight decay), no augmentation, no label smoothing.

    `vitscope train --preset fmnist_tutorial`
    """
    return TrainConfig(epochs=20, batch_size=128, lr=1e-3, min_lr=1e-3, weight_decay=0.0, warmup_epochs=0,
                       label_smoothing=0.0, clip_grad=None, amp="fp32", image=ImageOptions(
                           model="vit_tiny_patch4_28", model_args={"embed_dim": 32, "num_heads": 2, "mlp_ratio": 1.0},
                           augment=TrainTransform(crop="none", flip=False)))


# -- captioning (vitscope.caption; `--task caption`) ----------------------------------------------------
_SCENES = dict(task="caption", dataset="fmnist_scenes", optimizer="muon",
               batch_size=64, lr=1.5e-3, weight_decay=0.05, warmup_epochs=0.3,
               label_smoothing=0.1, eval_batch_size=500, eval_every_steps=156,
               image=ImageOptions(model="vit_fmnist_quick", augment=TrainTransform(crop="none", flip=False)))


@recipe
def caption_quick() -> TrainConfig:
    """Fashion-MNIST scenes captioned by the README's classifier's encoder and a transformer decoder, in
    minutes on 2 CPU cores.

    `make run` first (its classifier starts the encoder, as the lecture's captioners start from an ImageNet
    CNN; `--init-weights none` trains it from scratch), then `vitscope train --preset caption_quick`, then
    `vitscope eval RUN --beam 5` -> about 92% item accuracy with beam 5 and 95-96% of item words' last-layer
    attention in the right cell: 91.75% in 3.1 minutes on a Zen 5 EPYC (bfloat16, seed 0), 92.05% / 91.95%
    in 8.8 / 9.5 on a Zen 3 (float32, seeds 0, 1). Evidence and commands: benchmarks/RESULTS.md, Captioning.
    Why this recipe: a 2-block decoder of width 128 over the 196 image tokens, each with a learned 2-D position
    (MemoryPositions: without them items bind to the wrong cells for longer), Muon, batch 64, two epochs.
    Evaluate with beam search: greedy decoding repeats or skips an item in the random-order phrasings.
    """
    return TrainConfig(**_SCENES, epochs=2, caption=CaptionOptions(
        captioner="transformer", max_len=40,
        decoder_args=dict(dim=128, depth=2, num_heads=4, mlp_ratio=2.0, drop=0.0, memory_pos=True)))


_LSTM = dict(embed_dim=128, hidden_dim=256, attn_dim=128, drop=0.1, attention_reg=1.0, memory_pos=True)


@recipe
def caption_lstm_quick() -> TrainConfig:
    """The lecture's baseline on the same scenes: the same encoder (from the README's classifier) and an LSTM
    decoder that attends with additive attention at every word ("Show, Attend and Tell"), in about the
    transformer's training time: its recurrence runs word by word, so it gets one epoch where the
    transformer gets two.

    `make run` first, then `vitscope train --preset caption_lstm_quick`, then `vitscope eval RUN --beam 5`.
    It trains with AdamW at 1e-3, not the transformer's Muon: with the encoder frozen and 300 steps of the
    decoder alone, Muon at 1.5e-3 left the alignment at chance (24% of item words peaking in their cell,
    teacher-forced; 39% greedy item accuracy) where AdamW at 1e-3 reached 75% and 64%
    (`python benchmarks/caption_lstm_study.py frozen`, 3,000 training scenes, 200 test scenes). The
    regulariser keeps the paper's weight against the per-word cross-entropy (ShowAttendTell.memory_losses):
    in the same experiment (AdamW) it gave 68% greedy item accuracy and 82% grounding, where the former weight,
    18x the paper's, gave 50% and 56%, and the conv stem's grid as memory 63% and 86%.
    One epoch is short for it: its alignments sharpen late (benchmarks/RESULTS.md, "Show, Attend and Tell that
    attends"); `caption_lstm`, this recipe for three epochs, is the one measured end to end.
    """
    return TrainConfig(**{**_SCENES, "eval_every_steps": 78, "optimizer": "adamw", "lr": 1e-3}, epochs=1,
                       caption=CaptionOptions(captioner="lstm", max_len=40, decoder_args=dict(_LSTM)))


@recipe
def caption_lstm() -> TrainConfig:
    """Show, Attend and Tell for the accuracy target: caption_lstm_quick's recipe for three epochs.

    `make run` first (its classifier starts the encoder), then `vitscope train --preset caption_lstm`, then
    `vitscope eval RUN --beam 5` -> about 91% item accuracy with beam 5 and 89-94% of item words' alignments peaking
    in their cell: 91.75% / 89.3% (seed 0) and 90.53% / 93.6% (seed 1), in 13-14 minutes on one thread of a shared
    2-core Zen 5 EPYC (bfloat16). From scratch (`--init-weights none`) about 87% / 92%, 4.2 minutes on both cores
    of a quiet one. Evidence and commands: benchmarks/RESULTS.md. Why this recipe: AdamW (under Muon the alignment
    stayed at chance), the regulariser at the paper's weight, and each caption trained only to its end;
    `--decoder-set memory=stem` reads the conv stem's grid instead.
    """
    return TrainConfig(**{**_SCENES, "optimizer": "adamw", "lr": 1e-3}, epochs=3,
                       caption=CaptionOptions(captioner="lstm", max_len=40, decoder_args=dict(_LSTM)))


# -- translation (vitscope.translate; `--task translate`) ----------------------------------------------------
_PAIR = dict(task="translate", dataset="synthetic_pair",
             optimizer="adamw", batch_size=64, lr=2e-3, min_lr=1e-4, weight_decay=0.0, warmup_epochs=0.05,
             label_smoothing=0.0, amp="fp32", kernels=False, eval_every_steps=100, explain_images=12)


def _pair(translator: str, **decoder_args) -> TranslateOptions:
    """The translation recipes' sentences (20,000 training pairs, 1,000 test pairs, up to 20 words) for `translator`."""
    return TranslateOptions(translator=translator, decoder_args=decoder_args, train_sentences=20_000,
                            test_sentences=1_000, max_words=20)


@recipe
def translate_rnn() -> TrainConfig:
    """The RNN encoder-decoder with additive (Bahdanau) attention on the synthetic language pair: the alignment
    heatmap of the lecture, learned with no alignment supervision.

    `vitscope train --preset translate_rnn --threads 1` -> 100.00% exact sentence accuracy on the 1,000 test
    sentences (greedy and beam 5), 98.97% of target words' attention peaking on their gold source word, in 2.8
    minutes of training on one thread of a 2-core Zen 5 EPYC shared with other jobs (seed 0; 98.8% exact after
    200 steps, 1.0 minute). The misses are mostly a two-word verb's second word, which its first word predicts
    without looking. Evidence and commands: benchmarks/RESULTS.md, Translation.
    Why this recipe: a bidirectional GRU of 128 per direction, a GRU decoder that attends after reading the
    previous word, AdamW at 2e-3 in float32 (the GRU's small matrices gain nothing from bfloat16), batch 64.
    """
    return TrainConfig(**_PAIR, epochs=2, translate=_pair("rnn", attention=True))


@recipe
def translate_rnn_noattn() -> TrainConfig:
    """The same RNN without attention, trained as long: the decoder reads one context vector for the whole
    sentence (the bottleneck attention removed), so long sentences fail.

    `vitscope train --preset translate_rnn_noattn --threads 1` -> 67.00% exact sentence accuracy (69.3% with
    beam 5) in 3.8 minutes on one thread of a shared 2-core Zen 5 EPYC (seed 0): 98.6% of the sentences of 3-8
    words, 29.9% of those of 15-20 (`python benchmarks/translate_bottleneck.py`, benchmarks/RESULTS.md).
    Four epochs to the attention RNN's two, as its steps are faster: about the same training time.
    """
    return TrainConfig(**_PAIR, epochs=4, translate=_pair("rnn", attention=False))


@recipe
def translate_transformer() -> TrainConfig:
    """A transformer encoder-decoder on the same pair, for comparison: 2 + 2 pre-norm blocks of width 128,
    4 heads; its alignment is read per decoder layer and head (the best is reported).

    `vitscope train --preset translate_transformer --threads 1` -> 97.90% exact sentence accuracy (98.0% with
    beam 5), 90.6% alignment accuracy for its best head (decoder layer 1, head 2; the four heads of layer 1 87-91%,
    of layer 0 47-61%), in 2.6 minutes of training on one thread of a shared 2-core Zen 5 EPYC (seed 0). Evidence
    and commands: benchmarks/RESULTS.md, Translation.
    """
    return TrainConfig(**{**_PAIR, "lr": 1e-3}, epochs=2,
                       translate=_pair("transformer", dim=128, depth=2, num_heads=4, mlp_ratio=2.0, drop=0.1))
