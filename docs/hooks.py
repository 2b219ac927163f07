"""MkDocs hooks for vitscope's site.

Material's offline plugin adds a script from unpkg.com so that search works on pages opened as
files; a site that must read offline loads nothing remote, so that script is taken out again. Opened
as files, the site reads and navigates fully; search needs it served (`python -m http.server -d site`).

The home page's picture is drawn at build time (`on_files`) from the trained ViT that tutorial 2 loads
(docs/tutorials/checkpoints/, with the command that trained it): where its class token draws from on
four test images (attention rollout), and how alike its learned position vectors are across the grid.
Nothing in it is drawn by hand or kept as an image file.

Pages may link to files of the repository outside docs/ (`../benchmarks/RESULTS.md`),
which a view of the Markdown in the repository follows but the site does not hold. On the site such a
link becomes the path as text, so the strict build still fails on every link that is truly broken."""

from __future__ import annotations

import io
import posixpath
import re
from pathlib import Path

_LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)]*)?\)")


def _leaves_docs(page_uri: str, target: str) -> str | None:
    """The repository path `target` points to when it lies outside docs/, else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page_uri), target))
    return resolved[3:] if resolved.startswith("../") else None


def on_config(config):
    polyfills = config.extra.get("polyfills", [])
    config.extra["polyfills"] = [url for url in polyfills if "://" not in url]
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    def rewrite(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        path = _leaves_docs(page.file.src_uri, target)
        if path is None:
            return match.group(0)
        return text if path in text else f"{text} (`{path}` in the repository)"

    return _LINK.sub(rewrite, markdown)


HOME_FIGURE = "assets/home_attention.png"
CHECKPOINT = Path("tutorials/checkpoints/vit_fmnist_10ep.safetensors")


def _home_figure(docs_dir: Path) -> bytes:
    """The home page's picture, as PNG bytes: rollout maps of four test images of different classes, and the
    similarity of the trained position table's rows (the grid the model learned)."""
    import matplotlib

    matplotlib.use("Agg")
    import torch.nn.functional as F
    from einops import rearrange
    from matplotlib.figure import Figure

    from vitscope.data import eval_transform, load_dataset
    from vitscope.inspect import capture_attention, rollout, rollout_map
    from vitscope.inspect.plots import overlay
    from vitscope.weights import load_model

    model = load_model(docs_dir / CHECKPOINT)
    train, test = load_dataset("fashion_mnist", "train"), load_dataset("fashion_mnist", "test")
    picks, seen = [], set()
    for i, label in enumerate(test.labels.tolist()):  # the first test image of four different classes
        if label not in seen:
            picks.append(i)
            seen.add(label)
        if len(picks) == 4:
            break
    images = test.images[picks]
    capture = capture_attention(model, eval_transform(images, train.mean, train.std))
    maps = rollout_map(rollout(capture.layers(), num_prefix_tokens=1), capture.layout)
    predicted = capture.output.argmax(-1)
    gh, gw = capture.layout.grid
    rows = F.normalize(model.pos_embed[0, 1:].detach(), dim=-1)  # the patches' rows of the learned table
    centre = (gh // 2) * gw + gw // 2
    similarity = rearrange(rows @ rows[centre], "(h w) -> h w", h=gh)

    fig = Figure(figsize=(11, 2.7), layout="constrained")
    axes = fig.subplots(1, len(picks) + 1)
    for ax, image, amap, p in zip(axes, images, maps, predicted):
        overlay(ax, image, amap, title=f"predicted: {test.classes[int(p)]}")
    ax = axes[-1]
    im = ax.imshow(similarity, cmap="RdBu_r", vmin=-1, vmax=1)
    ax.plot(gw // 2, gh // 2, "k+", ms=10)
    ax.set(xticks=[], yticks=[])
    ax.set_title("learned positions: similarity\nto the centre patch's (+)", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle("A ViT trained on Fashion-MNIST: where the class token draws from (attention rollout), and the "
                 "grid its position table learned", fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, HOME_FIGURE, content=_home_figure(Path(config.docs_dir))))
    return files
