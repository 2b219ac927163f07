"""Caption decoding speed: vitscope against transformers' `generate`, and the KV cache against re-running
the prefix. Prints markdown tables with the machine beside them.

    .venv/bin/python benchmarks/bench_caption.py                        # vitscope vs transformers (default)
    .venv/bin/python benchmarks/bench_caption.py --rounds 3 --repeats 3 --threads 1
    .venv/bin/python benchmarks/bench_caption.py --cache                # KV cache vs none, batch vs loop
    .venv/bin/python benchmarks/bench_caption.py --curves RUN_DIR... --png benchmarks/caption_curves.png

Against transformers: `caption_quick`'s captioner (encoder width, depth, heads and MLP ratio, 56 x 56
scenes, 196 image tokens, decoder width 128, 2 blocks, 4 heads, MLP ratio 2, 40 positions, the scenes'
vocabulary) and transformers' `VisionEncoderDecoderModel` of the same shape: a `ViTModel` encoder and a
GPT-2 decoder with cross-attention (pre-norm like vitscope's), random weights. transformers' ViT has no
conv stem, so both encoders project 4 x 4 patches (vitscope's preset with `stem=[]`); the parameter counts
are printed and must agree within 5%. Both generate exactly N tokens from the images (the encoder
included): vitscope's <eos> logit is pushed to -1e9 and transformers is given no <eos>, so nothing ends
early. Greedy and beam 5, N = 20 and 32, float32 and bfloat16 autocast where the CPU runs bfloat16
natively, and a teacher-forced training step (AdamW) on N-token captions. Each implementation runs in its
own process, the processes take turns for --rounds rounds (the order rotating), and each figure is the
median of every timed run; vitscope runs with its kernels applied and without. Rates are printed from
the process's CPU time (one torch thread by default, so other jobs on a shared machine's cores do not
count) and from wall time. Every process, transformers' too, keeps freed memory in the process as `vitscope
caption` and `vitscope eval` do (vitscope.kernels.allocator), so no side pays page faults for tensors it
freed a moment before; `--default-allocator` leaves glibc's malloc as it is.

`--cache` times the cache against re-running the prefix on one captioner (same captions required) and
one batched beam search against a Python loop over the images.

`--curves` instead reads finished caption runs (`vitscope train --task caption`) and draws their test
metric (item accuracy on Fashion-MNIST scenes) against training wall time, all runs in one PNG, with a
table of each run's epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vitscope.caption.transformer import EncoderSpec, TransformerCaptioner, TransformerCaptionerConfig  # noqa: E402
from vitscope.sequence.decoding import beam_search, decode  # noqa: E402
from vitscope.sequence.vocab import BOS, EOS, PAD  # noqa: E402

IMPLS = ("vitscope", "vitscope-plain", "hf-sdpa", "hf-eager")
IMPL_NAMES = {"vitscope": "vitscope, kernels applied", "vitscope-plain": "vitscope, plain PyTorch",
              "hf-sdpa": "transformers, sdpa attention", "hf-eager": "transformers, eager attention"}


def _header(extra: dict | None = None) -> str:
    try:
        from _machine import machine_header

        return machine_header(extra)
    except Exception:  # the shared helper is optional here: fall back to the essentials
        import platform

        cpu = platform.processor() or platform.machine()
        return f"- {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _median_time(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up (and the result to compare)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def build(max_len: int, vocab: int, dim: int, depth: int) -> TransformerCaptioner:
    torch.manual_seed(0)
    enc = EncoderSpec("vit_tiny_patch7_28", dict(img_size=56, depth=3, embed_dim=128, num_heads=4))
    model = TransformerCaptioner(TransformerCaptionerConfig(vocab_size=vocab, encoder=enc, dim=dim, depth=depth,
                                                            num_heads=4, max_len=max_len, drop=0.0)).eval()
    with torch.no_grad():
        model.decoder.head.bias[EOS] = -1e9  # captions run to max_len
    return model


# -- vitscope against transformers' generate -----------------------------------------------------------
def quick_shape(small: bool = False) -> dict:
    """caption_quick's captioner, its encoder's conv stem replaced by a 4 x 4 patch projection (transformers'
    ViT has none): the fields both implementations are built from. `small` shrinks it for a smoke test."""
    import numpy as np

    from vitscope.caption.scenes import ITEM, Scene, ScenesConfig, scene_captions
    from vitscope.models import get_config
    from vitscope.sequence.vocab import Vocabulary
    from vitscope.training.recipes import caption_quick

    recipe = caption_quick()
    img = ScenesConfig().cells * ITEM
    enc = get_config(recipe.image.model, img_size=img, stem=[], patch_size=4)
    # The scenes' vocabulary: every class, count and cell appears in a few hundred random scenes' captions.
    rng = np.random.default_rng(0)
    scenes = [Scene(2, tuple((c, int(rng.integers(10))) for c in sorted(rng.choice(4, n, replace=False))))
              for n in (1, 2, 3, 4) for _ in range(100)]
    vocab = Vocabulary.build([c for sc in scenes for c in scene_captions(sc, rng)])
    d = recipe.caption.decoder_args
    shape = dict(preset=recipe.image.model, img=img, patch=4, in_chans=enc.in_chans, enc_dim=enc.embed_dim,
                 enc_depth=enc.depth, enc_heads=enc.num_heads, enc_mlp=enc.mlp_ratio, dim=d["dim"], depth=d["depth"],
                 heads=d["num_heads"], mlp=d["mlp_ratio"], max_len=recipe.caption.max_len, vocab=len(vocab),
                 memory_pos=d.get("memory_pos", False))
    if small:
        shape.update(img=16, enc_dim=32, enc_heads=2, dim=32, heads=2)
    return shape


def build_impl(impl: str, shape: dict):
    """The captioner of `impl`, float32, random weights, with <eos> unable to end a caption."""
    torch.manual_seed(0)
    if impl.startswith("vitscope"):
        from vitscope import kernels

        enc = EncoderSpec(shape["preset"], dict(img_size=shape["img"], stem=[], patch_size=shape["patch"],
                                               embed_dim=shape["enc_dim"], depth=shape["enc_depth"],
                                               num_heads=shape["enc_heads"], mlp_ratio=shape["enc_mlp"]))
        model = TransformerCaptioner(TransformerCaptionerConfig(
            vocab_size=shape["vocab"], encoder=enc, dim=shape["dim"], depth=shape["depth"], num_heads=shape["heads"],
            mlp_ratio=shape["mlp"], max_len=shape["max_len"], drop=0.0, memory_pos=shape["memory_pos"]))
        with torch.no_grad():
            model.decoder.head.bias[EOS] = -1e9  # every caption runs to its full length
        return kernels.apply(model) if impl == "vitscope" else model
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    attn = impl.removeprefix("hf-")
    enc = ViTConfig(hidden_size=shape["enc_dim"], num_hidden_layers=shape["enc_depth"],
                    num_attention_heads=shape["enc_heads"], intermediate_size=int(shape["enc_dim"] * shape["enc_mlp"]),
                    image_size=shape["img"], patch_size=shape["patch"], num_channels=shape["in_chans"],
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    dec = GPT2Config(vocab_size=shape["vocab"], n_positions=shape["max_len"], n_embd=shape["dim"],
                     n_layer=shape["depth"], n_head=shape["heads"], n_inner=int(shape["dim"] * shape["mlp"]),
                     add_cross_attention=True, is_decoder=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     activation_function="gelu", bos_token_id=BOS, eos_token_id=None, pad_token_id=PAD)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = BOS, PAD, None
    model = VisionEncoderDecoderModel(config=config)
    model.set_attn_implementation(attn)
    if model.decoder.config._attn_implementation != attn:
        raise RuntimeError(f"transformers chose attention {model.decoder.config._attn_implementation!r}")
    return model


def _generate(impl: str, model, images: Tensor, n: int, beam: int) -> Tensor:
    """(B, n + 1) tokens, <bos> first."""
    if impl.startswith("vitscope"):
        return decode(model, images, beam=beam, max_len=n + 1).tokens
    return model.generate(pixel_values=images, max_new_tokens=n, num_beams=beam, do_sample=False, eos_token_id=None,
                          pad_token_id=PAD, decoder_start_token_id=BOS, use_cache=True)


def _train_step(impl: str, model, opt, images: Tensor, tokens: Tensor, bf16: bool) -> None:
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if impl.startswith("vitscope"):
            loss = model.loss(images, tokens)
        else:
            logits = model(pixel_values=images, decoder_input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_impl(spec: dict) -> dict:
    """One implementation's cases in this process: {case name: [seconds per timed run]}."""
    torch.set_num_threads(spec["threads"])
    if spec.get("keep_freed_memory"):  # what `vitscope caption` and `eval` do; every implementation gets it
        from vitscope.kernels.allocator import keep_freed_memory

        keep_freed_memory()
    shape, impl = spec["shape"], spec["impl"]
    model = build_impl(impl, shape)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(spec["batch"], shape["in_chans"], shape["img"], shape["img"], generator=g)
    times: dict[str, list[float]] = {}  # process CPU seconds: other jobs on shared cores do not count
    walls: dict[str, list[float]] = {}
    for case in spec["cases"]:
        mode, n, dtype = case["mode"], case["n"], case["dtype"]
        bf16 = dtype == "bfloat16"
        if mode == "train":
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(4, shape["vocab"], (spec["batch"], n + 1), generator=g)
            tokens[:, 0] = BOS

            def run(opt=opt, tokens=tokens, bf16=bf16):
                _train_step(impl, model, opt, images, tokens, bf16)
        else:
            model.eval()
            beam = 1 if mode == "greedy" else int(mode.removeprefix("beam "))

            def run(n=n, beam=beam, bf16=bf16):
                with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    out = _generate(impl, model, images, n, beam)
                if out.shape != (spec["batch"], n + 1):
                    raise RuntimeError(f"{impl} generated {tuple(out.shape)}, not {(spec['batch'], n + 1)}")
        run()  # warm-up
        spent, wall = [], []
        for _ in range(spec["repeats"]):
            t, w = time.process_time(), time.perf_counter()
            run()
            spent.append(time.process_time() - t)
            wall.append(time.perf_counter() - w)
        times[case_name(case)] = spent
        walls[case_name(case)] = wall
    return {"impl": impl, "params": sum(p.numel() for p in model.parameters()), "times": times, "wall": walls}


def case_name(case: dict) -> str:
    what = "training step" if case["mode"] == "train" else case["mode"]
    return f"{what}, N = {case['n']}, {case['dtype']}"


def spawn(spec: dict) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{spec['impl']} worker failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def compare(args) -> None:
    from vitscope.kernels import bf16 as bf16_support

    shape = quick_shape(small=args.small)
    dtypes = [dt for dt in ["float32"] + (["bfloat16"] if bf16_support.native_matmul() else []) if dt in args.dtypes]
    modes = [m for m in ("greedy", f"beam {args.beam}") if m.split()[0] in args.modes]
    cases = [dict(mode=mode, n=n, dtype=dt) for dt in dtypes for n in args.lengths for mode in modes]
    cases += [dict(mode="train", n=args.lengths[-1], dtype=dt) for dt in dtypes if "train" in args.modes]
    import transformers

    print(_header(dict(transformers=transformers.__version__, torch_threads=args.threads)))
    print(f"\ncaption_quick's shape: encoder width {shape['enc_dim']}, {shape['enc_depth']} blocks, "
          f"{shape['enc_heads']} heads, {shape['img']} x {shape['img']} images in {shape['patch']} x {shape['patch']} "
          f"patches; decoder width {shape['dim']}, {shape['depth']} blocks, {shape['heads']} heads, MLP ratio "
          f"{shape['mlp']}, vocabulary {shape['vocab']}; batch {args.batch}; {args.rounds} rounds x {args.repeats} "
          f"timed runs per figure; glibc's malloc "
          f"{'as it is' if args.default_allocator else 'keeping freed memory'} in every implementation's process\n")
    results: dict[str, dict] = {}
    for r in range(args.rounds):
        order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
        for impl in order:
            spec = dict(impl=impl, shape=shape, cases=cases, batch=args.batch, repeats=args.repeats,
                        threads=args.threads, keep_freed_memory=not args.default_allocator)
            out = spawn(spec)
            kept = results.setdefault(impl, {"params": out["params"], "times": {}, "wall": {}})
            for key in ("times", "wall"):
                for name, t in out[key].items():
                    kept[key].setdefault(name, []).extend(t)
        loads = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"round {r + 1}/{args.rounds} done, load average {loads}", flush=True)

    params = {impl: results[impl]["params"] for impl in IMPLS}
    print("\n| implementation | parameters |\n|---|---:|")
    for impl in IMPLS:
        print(f"| {IMPL_NAMES[impl]} | {params[impl]:,} |")
    gap = abs(params["vitscope"] - params["hf-sdpa"]) / params["hf-sdpa"]
    print(f"\nparameter counts differ by {100 * gap:.1f}%" + ("" if gap <= 0.05 else " (more than 5%: not comparable)"))

    for key, what in (("times", "process CPU time"), ("wall", "wall time")):
        print(f"\nImages/s from the median {what} per batch; the ratios against the faster transformers variant:\n")
        print("| case | vitscope, kernels | vitscope, plain | transformers sdpa | transformers eager "
              "| kernels vs transformers | plain vs transformers |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for case in cases:
            name = case_name(case)
            v, p, s, e = (args.batch / statistics.median(results[impl][key][name]) for impl in IMPLS)
            best = max(s, e)
            print(f"| {name} | {v:,.1f} | {p:,.1f} | {s:,.1f} | {e:,.1f} | {v / best:.2f}x | {p / best:.2f}x |")


def worker(spec: dict) -> None:
    print("RESULT " + json.dumps(run_impl(spec)), flush=True)


def curves(run_dirs: list[Path], png: Path | None) -> None:
    """Each caption run's evaluations against its training time: a markdown table, and one PNG of all."""
    import json

    runs = []
    for d in run_dirs:
        cfg = json.loads((d / "config.json").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
        init = (cfg.get("image") or cfg).get("init_weights")  # nested, or older
        start = f"encoder from {Path(init).parent.name}" if init else "from scratch"
        captioner = (cfg.get("caption") or {}).get("captioner") or cfg.get("captioner", "?")  # nested, or older
        label = f"{captioner}, {start}, seed {cfg.get('seed')}"
        runs.append((label, rows))
    print(_header() + "\n")
    print("| run | epoch | train min (wall) | train min (CPU) | item accuracy % | exact match % | BLEU-4 | CIDEr-D "
          "| grounding % |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, rows in runs:
        for r in rows:
            cpu_min = f"{r['train_cpu_s'] / 60:.1f}" if "train_cpu_s" in r else "-"
            print(f"| {label} | {r['epoch']:.2f} | {r['train_time_s'] / 60:.1f} | {cpu_min} | "
                  f"{100 * r['test_item_accuracy']:.2f} | "
                  f"{100 * r.get('test_exact_match', float('nan')):.2f} | {r.get('test_bleu4', float('nan')):.4f} | "
                  f"{r.get('test_cider', float('nan')):.3f} | {100 * r.get('test_grounding', float('nan')):.1f} |")
    if png is None:
        return
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    ax = fig.subplots()
    # CPU time when every row has it: on a shared machine it counts this run's work, not the other jobs'.
    cpu = all("train_cpu_s" in r for _, rows in runs for r in rows)
    key = "train_cpu_s" if cpu else "train_time_s"
    for label, rows in runs:
        ax.plot([0] + [r[key] / 60 for r in rows], [0] + [100 * r["test_item_accuracy"] for r in rows], "o-",
                label=label)
    ax.set(xlabel="training CPU time (min, all the run's threads)" if cpu else "training wall time (min)",
           ylabel="test item accuracy (%), greedy",
           title="Fashion-MNIST scenes: transformer vs LSTM-with-attention captioner")
    machine = next((line[7:] for line in _header().splitlines() if line.startswith("- CPU: ")), "")
    fig.text(0.01, 0.005, f"{machine}; item accuracy as the loop evaluates it (greedy)", fontsize=7, color="0.4")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    print(f"\nwrote {png}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curves", type=Path, nargs="+", metavar="RUN_DIR",
                    help="instead of timing decoding: plot these caption runs' test metric against training time")
    ap.add_argument("--png", type=Path, help="with --curves: the figure's path")
    ap.add_argument("--cache", action="store_true",
                    help="instead of transformers: time the KV cache against re-running the prefix")
    ap.add_argument("--rounds", type=int, default=2, help="turns each implementation's process takes")
    ap.add_argument("--small", action="store_true", help="a tiny captioner (a smoke test of the script)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", type=int, nargs="+", default=[20, 32])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--default-allocator", action="store_true",
                    help="against transformers: leave glibc's malloc as it is in every process (by default each one "
                         "keeps freed memory, as `vitscope caption` and `eval` do: vitscope.kernels.allocator)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                    help="against transformers: the dtypes to time (bfloat16 only where the CPU runs it natively)")
    ap.add_argument("--modes", nargs="+", default=["greedy", "beam", "train"], choices=["greedy", "beam", "train"],
                    help="against transformers: the cases to time")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=40)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.curves:
        curves(args.curves, args.png)
        return
    torch.set_num_threads(args.threads)
    if not args.cache:
        compare(args)
        return
    print(_header())
    print(f"\ndecoder dim {args.dim}, depth {args.depth}, vocabulary {args.vocab}; 56x56 images, 64 image tokens "
          f"+ CLS; batch {args.batch}; median of {args.repeats}\n")
    images = torch.randn(args.batch, 1, 56, 56)

    print("| decoding | length | with KV cache (s) | without (s) | speed-up | same captions |")
    print("|---|---:|---:|---:|---:|---|")
    for length in args.lengths:
        model = build(length, args.vocab, args.dim, args.depth)
        memory = model.encode(images).detach()
        for name, beam in (("greedy", 1), (f"beam {args.beam}", args.beam)):
            def run(cache, model=model, memory=memory, beam=beam):
                return decode(model, memory=memory, beam=beam, use_cache=cache)

            t_cache, a = _median_time(lambda: run(True), args.repeats)  # noqa: B023 (called at once)
            t_plain, b = _median_time(lambda: run(False), args.repeats)  # noqa: B023
            same = torch.equal(a.tokens, b.tokens)
            print(f"| {name} | {length} | {t_cache:.3f} | {t_plain:.3f} | {t_plain / t_cache:.2f}x | {same} |")

    length = args.lengths[0]
    model = build(length, args.vocab, args.dim, args.depth)
    memory = model.encode(images).detach()
    print(f"\n| beam {args.beam}, length {length} | time (s) | speed-up | same captions |")
    print("|---|---:|---:|---|")
    t_batch, a = _median_time(lambda: beam_search(model, memory=memory, beam=args.beam), args.repeats)
    t_loop, rows = _median_time(lambda: [beam_search(model, memory=memory[i:i + 1], beam=args.beam)
                                         for i in range(args.batch)], args.repeats)
    same = all(torch.equal(a.tokens[i], r.tokens[0]) for i, r in enumerate(rows))
    print(f"| one batched call, {args.batch} images x {args.beam} beams | {t_batch:.3f} | "
          f"{t_loop / t_batch:.2f}x | {same} |")
    print(f"| Python loop over the {args.batch} images | {t_loop:.3f} | 1.00x | |")


if __name__ == "__main__":
    main()
