"""Training recipes: a named TrainConfig with the command to run it and what to expect.

Each docstring gives the command, the time on the stated machine and the measured result; the
figures and the scripts that measured them are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Callable

from vitscope.data.transforms import TrainTransform
from vitscope.errors import ConfigError
from vitscope.training.loop import TrainConfig

_RECIPES: dict[str, Callable[[], TrainConfig]] = {}


def recipe(fn: Callable[[], TrainConfig]) -> Callable[[], TrainConfig]:
    _RECIPES[fn.__name__] = fn
    return fn


def list_recipes() -> list[str]:
    return sorted(_RECIPES)


# A preset whose model starts from another preset's trained weights: the run folder holding them is the
# caller's to find (the CLI reads the one `make run` writes), so the library names the preset, not a path.
STARTS_FROM = {"caption_quick": "fmnist_quick", "caption_lstm_quick": "fmnist_quick"}


def get_recipe(name: str) -> TrainConfig:
    if name not in _RECIPES:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(list_recipes())}")
    return _RECIPES[name]()


def recipe_doc(name: str) -> str:
    return (_RECIPES[name].__doc__ or "").strip().splitlines()[0]


@recipe
def fmnist_quick() -> TrainConfig:
    """Fashion-MNIST in about 5-8 minutes on 2 CPU cores with bfloat16, 22 without (the README's main job).

    `vitscope train --preset fmnist_quick`
    Figures with their commands are in benchmarks/RESULTS.md. The model is a five-conv stem to 7 x 7
    tokens and 2 blocks (see models.vit_fmnist_quick), for seven epochs: eight took 10.7 min on a
    slow spell of the EPYC host (749 images/s, AdamW), and seven reach the same accuracy. In so few epochs
    regularising costs more than it gives, so it gets flips only: random crops cost 2.5 points at
    two epochs, and random erasing cost 0.3 points at ten (91.32% against 91.65%, previous model).
    It is evaluated on each test image and its mirror image, logits averaged (`eval_flip`: 0.4
    points for eight epochs); shifted views would cost, since it never trains on shifted images.
    It trains with Muon on the hidden matrices (optim.py), which fits faster per step: 93.86% and
    93.71% for seeds 0 and 1 in 4.7 and 4.8 minutes on a 2-core Xeon with AMX (~1,470 images/s),
    against 92.91% for both seeds with AdamW (7.7-9.0 minutes on a 2-core EPYC without AMX). On a 2-core
    Zen 3 EPYC (AVX2, no bfloat16 arithmetic: float32 throughout, Muon's iteration in float32 rounded to
    bfloat16) 93.73% for seed 0 in 20.3 minutes (343 images/s; 93.67% in 21.8 before vitscope's float32
    linear kernel).
    """
    return TrainConfig(model="vit_fmnist_quick", optimizer="muon", epochs=7, batch_size=128, lr=1.5e-3,
                       weight_decay=0.05, warmup_epochs=0.3, label_smoothing=0.1, eval_flip=True,
                       augment=TrainTransform(crop="none", flip=True))


@recipe
def fmnist_best() -> TrainConfig:
    """Fashion-MNIST, the accuracy preset: under 60 minutes on 2 CPU cores.

    `vitscope train --preset fmnist_best`
    Figures with their commands are in benchmarks/RESULTS.md. The quick preset's model
    (models.vit_fmnist_quick) for 46 epochs with Muon on the hidden matrices (optim.py): 95.01% and
    95.16% for seeds 0 and 1 (10 test views) in 31.5 and 30.8 minutes of training on a 2-core Xeon
    with AMX (~1,480 images/s), and 95.09% and 95.16% in 28.4 and 28.1 minutes since the explicit
    attention path keeps bfloat16 weights (~1,630 images/s); 95.18% for seed 0 in 57.6 minutes on a
    2-core EPYC without AMX (797 images/s), and 95.12% in 41.1 minutes (1,117 images/s) with vitscope's
    C kernels (vitscope/kernels/native/, the conv stem's weight gradients included), 95.00% in 40.6 (1,132
    images/s) with its linear-product kernel too, whose sums run in another order, and 95.25% in 39.2
    (1,173 images/s) once the weight gradients summed chunks of 128 rows. With AdamW the same
    recipe reached 94.67% and 94.72% for seeds 0 and 1 (EPYC, 52-56 minutes): it underfits (96.4% on
    its own training images), and Muon fits faster per step, 0.7-1.9 points ahead over the first half
    and 0.2-0.3 at the end.
    A deeper model loses: a third block was behind at every epoch, and the three-conv, four-block
    model reached 92.84% in 36 epochs, because the small model's faster step buys more epochs; a
    sixth stem conv, with 40 epochs in the same time, only tied it (94.70% for seed 0, AdamW). So
    many epochs need regularising: pad-2 random crops, flips, random erasing (a tie: 94.68% without
    it), and CutMix on half the batches, which added 0.15 points on 10 views (AdamW). Each epoch is
    evaluated on every test image and its mirror image (`eval_flip`); the final evaluation also
    averages each of them moved one pixel left, right, up and down (`final_eval_shift`, 10 views;
    airbench averages mirrored, shifted views for CIFAR-10 too). More epochs bought little with
    AdamW: without CutMix, 70 (83 minutes) reached 94.67% for seed 0.
    """
    return TrainConfig(model="vit_fmnist_quick", optimizer="muon", epochs=46, batch_size=128, lr=1.5e-3,
                       weight_decay=0.05, warmup_epochs=1, label_smoothing=0.1, ema_decay=None, eval_flip=True,
                       final_eval_shift=1, augment=TrainTransform(crop="pad", pad=2, flip=True, erase_p=0.25,
                                                                  cutmix_alpha=1.0, mix_prob=0.5))


@recipe
def fmnist_tutorial() -> TrainConfig:
    """The tutorials' ViT and recipe on Fashion-MNIST, for comparison: width 32, 2 heads, 6 layers,
    patch 4, Adam (no weight decay), no augmentation, no label smoothing.

    `vitscope train --preset fmnist_tutorial`
    """
    return TrainConfig(model="vit_tiny_patch4_28", model_args={"embed_dim": 32, "num_heads": 2, "mlp_ratio": 1.0},
                       epochs=20, batch_size=128, lr=1e-3, min_lr=1e-3, weight_decay=0.0, warmup_epochs=0,
                       label_smoothing=0.0, clip_grad=None, amp="fp32",
                       augment=TrainTransform(crop="none", flip=False))


# -- captioning (vitscope.caption; `--task caption`) ----------------------------------------------------
_SCENES = dict(task="caption", dataset="fmnist_scenes", model="vit_fmnist_quick", max_len=40, optimizer="muon",
               batch_size=64, lr=1.5e-3, weight_decay=0.05, warmup_epochs=0.3,
               label_smoothing=0.1, eval_batch_size=500, eval_every_steps=156,
               augment=TrainTransform(crop="none", flip=False))


@recipe
def caption_quick() -> TrainConfig:
    """Fashion-MNIST scenes captioned by the README's classifier's encoder and a transformer decoder, in
    about 9 minutes of training on 2 CPU cores.

    `make run` first (its classifier starts the encoder), then `vitscope train --preset caption_quick`, then
    `vitscope eval RUN --beam 5`. As the lecture's captioners start from an ImageNet CNN, the encoder starts
    from runs/fmnist_quick (models.vit_fmnist_quick, here on the 56 x 56 canvas: its stride-4 stem gives each
    28 x 28 cell the 7 x 7 tokens the classifier gives an item; STARTS_FROM, and from Python pass init_weights);
    `--init-weights none` trains it from scratch.
    The decoder is 2 blocks of width 128 over the 196 image tokens, which carry a learned 2-D position each
    (caption.transformer.MemoryPositions: without them the decoder binds items to the wrong cells longer).
    Muon, batch 64, label smoothing 0.1, one of each image's five references per epoch, two epochs; the loop
    evaluates every half epoch, greedily. Evaluate the run with beam search (`vitscope eval RUN --beam 5`):
    greedy decoding repeats or skips an item in the phrasings that list items in a random order, and beam
    search prefers the reading-order ones. On a 2-core Zen 3 EPYC (float32): 92.05% and 91.95% item accuracy
    with beam 5 (87.78%, 91.46% greedy) for seeds 0 and 1 after 8.8 and 9.5 minutes; commands and the rest in
    benchmarks/RESULTS.md, Captioning.
    """
    return TrainConfig(**_SCENES, captioner="transformer", epochs=2,
                       decoder_args=dict(dim=128, depth=2, num_heads=4, mlp_ratio=2.0, drop=0.0, memory_pos=True))


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
    Not yet measured end to end on a quiet machine: on a 2-core EPYC shared with other jobs the run reached
    step 142 of 312 in 15 minutes, where beam 5 named 20% of the items in 500 test scenes and the alignment
    peaked in the right cell for 41% of item words (chance 25%).
    """
    return TrainConfig(**{**_SCENES, "eval_every_steps": 78, "optimizer": "adamw", "lr": 1e-3}, captioner="lstm",
                       epochs=1, decoder_args=dict(_LSTM))


@recipe
def caption_lstm() -> TrainConfig:
    """Show, Attend and Tell for the accuracy target (85% item accuracy with beam 5, 85% of item words'
    alignments in their cell): caption_lstm_quick's recipe for three epochs.

    `make run` first, then `vitscope train --preset caption_lstm`, then `vitscope eval RUN --beam 5`.
    Not yet measured: the figures that chose its recipe are caption_lstm_quick's. Training steps each caption
    only to its end (2.1x faster for the decoder than running every row for the longest caption), so three
    epochs should take about 20 minutes on 2 quiet cores; `--decoder-set memory=stem` reads the conv stem's grid
    instead of the last block's tokens.
    """
    return TrainConfig(**{**_SCENES, "optimizer": "adamw", "lr": 1e-3}, captioner="lstm", epochs=3,
                       decoder_args=dict(_LSTM))
