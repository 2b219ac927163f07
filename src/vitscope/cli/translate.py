"""`vitscope translate RUN "SENTENCE"... [--beam 5] [--json]`: translations of source sentences, with where each
target word looked.

The main CLI adds the sub-command with `add_translate_parser(subparsers)`; `run_translate(args)` returns the exit
code (0 done; a user error, such as a word the translator never saw, raises and is printed as one line, code 2).
`vitscope eval RUN` scores a translator on its test sentences.
"""

from __future__ import annotations

import argparse
import json

from vitscope.cli.common import UsageError, add_decoding_options, add_kernels_flag, decode_options


def add_translate_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "translate", help="translate sentences of the synthetic language pair with a trained translator",
        description="Translate source sentences with a translation run (vitscope train --task translate); each "
                    "target word is printed with the source word its attention peaked on. A sentence outside the "
                    "source language's grammar (its adjectives follow the noun) is translated all the same, with a "
                    "note on stderr giving the grammatical order where there is one.",
        epilog='examples:\n  vitscope translate runs/translate_rnn "the dog small black sees a cat"\n'
               '  vitscope translate runs/translate_rnn "a king helps the child" --beam 5 --json',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="RUN", help="a translation run directory (best.safetensors, else last) or its "
                                                ".safetensors checkpoint")
    p.add_argument("sentences", metavar="SENTENCE", nargs="+", help="source sentences, each one argument")
    add_decoding_options(p, beam_default=5, vocab=False)
    p.add_argument("--json", action="store_true",
                   help="print JSON (source, translation, words, attention peaks, score, and a note for a sentence "
                        "outside the training language's grammar) instead of lines")
    add_kernels_flag(p)
    p.set_defaults(run=run_translate)
    return p


def run_translate(args) -> int:
    import sys

    from vitscope.translate.language import grammar_note, split_sentence
    from vitscope.translate.run import is_translation_checkpoint, open_translator

    if not is_translation_checkpoint(args.model):
        raise UsageError(f"{args.model} is not a translation run (train one with vitscope train --task translate "
                         f"--preset translate_rnn)")
    options = decode_options(args)
    run = open_translator(args.model, kernels=args.kernels)
    options.check(run.model)
    sentences = [split_sentence(s) for s in args.sentences]
    results = run.translate(sentences, **options.kwargs())
    rows = []
    for r in results:
        why = grammar_note(r.source)
        # not refused: a learner may want to see what the model makes of a sentence it never saw
        note = None if why is None else (f"not a sentence of the training language ({why}); the translation below "
                                         f"is the model's guess.")
        if note is not None:
            print(f"note: {note}" if len(results) == 1 else f"note: {' '.join(r.source)!r}: {note}",
                  file=sys.stderr, flush=True)
        peaks = None
        if run.model.has_attention:
            att = r.attention if r.attention.ndim == 2 else r.attention.mean((1, 2))  # (T, N): a transformer's mean
            peaks = [r.source[int(k)] for k in att[: len(r.words)].argmax(-1)]
        rows.append({"source": " ".join(r.source), "translation": " ".join(r.words), "words": r.words,
                     "looked_at": peaks, "score": round(r.score, 4), "note": note})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(row["translation"])
        if row["looked_at"] is not None:
            print("  " + "  ".join(f"{w}<-{s}" for w, s in zip(row["words"], row["looked_at"])))
    return 0


def run_translation_eval(args) -> int:
    """`vitscope eval RUN` for a translation run: its test sentences (drawn again from the run's seed) translated
    greedily and with beam search of size --beam, side by side."""
    from pathlib import Path

    from vitscope.cli.common import check_out_dir
    from vitscope.training.options import nest_task_options
    from vitscope.translate.builders import ParallelData
    from vitscope.translate.evaluate import evaluate_translations
    from vitscope.translate.language import make_pair
    from vitscope.translate.run import open_translator

    options = decode_options(args)
    out_dir = check_out_dir(args.out, writes=("eval.json",), overwrite=args.overwrite) if args.out else None
    run = open_translator(args.checkpoint, kernels=args.kernels)
    options.check(run.model)
    cfg = nest_task_options(run.train_config)  # its options nested, whenever it was trained
    sentences = cfg.get("translate") if isinstance(cfg.get("translate"), dict) else {}
    if args.dataset not in (None, "synthetic_pair") or args.split not in (None, "test"):
        raise UsageError("a translator is evaluated on its own test sentences (drop --dataset and --split)")
    pair = make_pair(cfg.get("seed", 0), train_size=sentences.get("train_sentences", 20_000),
                     test_size=sentences.get("test_sentences", 1_000), max_words=run.max_words)
    data = ParallelData.build(pair)
    if data.src_vocab != run.src_vocab or data.tgt_vocab != run.tgt_vocab:
        raise UsageError(f"{run.source}: the sentences drawn again from its config do not give the vocabularies it "
                         f"was trained with; was its config.json edited?")
    rows = {}
    for beam in dict.fromkeys((1, args.beam)):
        result = evaluate_translations(run.model, data.test, run.tgt_vocab, **{**options.kwargs(), "beam": beam},
                                       batch_size=args.batch_size, bf16=args.amp == "bf16")
        rows["greedy" if beam == 1 else f"beam {beam}"] = result
    summary = {"checkpoint": str(run.source), "translator": run.description, "amp": args.amp,
               "sentences": len(data.test),
               "decoding": {k: r.metrics for k, r in rows.items()},
               "exact_match_by_source_length": {k: {str(n): v for n, v in r.by_length.items()}
                                                for k, r in rows.items()}}
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "eval.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{run.description}: {len(data.test)} test sentences of the synthetic language pair")
    print(f"{'decoding':<10}{'exact':>10}{'tokens':>10}{'BLEU-4':>10}{'alignment':>11}")
    for key, r in rows.items():
        m = r.metrics
        align = "n/a" if m["alignment"] is None else f"{100 * m['alignment']:.2f}%"
        print(f"{key:<10}{100 * m['exact_match']:>9.2f}%{100 * m['token_accuracy']:>9.2f}%{m['bleu4']:>10.4f}"
              f"{align:>11}")
    best = rows["greedy"].metrics.get("alignment_best_head")
    if best is not None:
        print(f"alignment: the best decoder head is layer {best[0]}, head {best[1]} (every head: --json)")
    return 0
