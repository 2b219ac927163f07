"""Capture attention weights from any vitscope model without changing its code.

Every `MultiHeadAttention` has a `capture` attribute: when it is set, the module computes the
explicit softmax path and hands its weights (B, H, Nq, Nk) to the callable on every forward,
whatever kernel would normally run. This module sets those attributes for the duration of a
capture and always puts the old values back, even when the forward raises.

Layers are named as `model.named_modules()` names them (`blocks.3.attn`,
`decoder.blocks.0.cross_attn`, ...); an integer `i` means the i-th attention module in model
order, which for a ViT is block i.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vitscope.attention import MultiHeadAttention
from vitscope.errors import VitscopeError
from vitscope.vit import PatchEmbed

# A capture may take this share of the memory the system reports as available.
DEFAULT_MEMORY_FRACTION = 0.5


class CaptureTooLarge(VitscopeError, MemoryError):
    """A capture would hold more attention weights than `max_bytes` allows."""


@dataclass(frozen=True)
class TokenLayout:
    """How a ViT's tokens map onto the image: `num_prefix_tokens` (CLS, ...) first, then the
    patches of a `grid` = (h, w) in row-major order, each `patch_size` pixels square."""

    num_prefix_tokens: int
    grid: tuple[int, int]
    patch_size: int
    image_size: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    def to_dict(self) -> dict:
        return {"num_prefix_tokens": self.num_prefix_tokens, "grid": list(self.grid),
                "patch_size": self.patch_size, "image_size": list(self.image_size)}


@dataclass
class AttentionCapture:
    """Attention weights per module name, in model order, each a list with one entry per call.

    For an encoder-only forward each module is called once: `capture[i]` or `capture["blocks.0.attn"]`
    gives (B, H, Nq, Nk) float32. Modules called several times (a decoder generating token by token)
    keep every call in `calls[name]`.
    """

    calls: dict[str, list[Tensor]] = field(default_factory=dict)
    layout: TokenLayout | None = None
    output: Tensor | None = None  # what the model returned, when the capture ran the forward

    @property
    def names(self) -> list[str]:
        return [n for n, c in self.calls.items() if c]

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, key: int | str) -> Tensor:
        name = self.names[key] if isinstance(key, int) else key
        calls = self.calls[name]
        if len(calls) != 1:
            raise ValueError(f"{name} was called {len(calls)} times during the capture; "
                             f"read each call from `capture.calls[{name!r}]`")
        return calls[0]

    def layers(self, pattern: str = "*") -> list[Tensor]:
        """Weights of every captured module whose name matches `pattern`, in model order."""
        return [self[n] for n in self.names if fnmatch.fnmatch(n, pattern)]

    def stack(self, pattern: str = "*") -> Tensor:
        """(L, B, H, N, N): the matching layers stacked; they must share one shape."""
        return torch.stack(self.layers(pattern))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.calls.values() for t in c)


def attention_modules(model: nn.Module) -> list[tuple[str, MultiHeadAttention]]:
    """Every MultiHeadAttention in `model`, with its name, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]


def model_device(model: nn.Module, default: torch.device | None = None) -> torch.device:
    """The device the model's parameters are on (its first's), else `default`: where its inputs must go."""
    return next((p.device for p in model.parameters()), default or torch.device("cpu"))


def select_modules(model: nn.Module, layers: int | str | Iterable[int | str] | None = None
                   ) -> list[tuple[str, MultiHeadAttention]]:
    """Choose attention modules by index (negative allowed), exact name or fnmatch pattern."""
    found = attention_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no MultiHeadAttention module to capture")
    if layers is None:
        return found
    if isinstance(layers, (int, str)):
        layers = [layers]
    chosen: dict[str, MultiHeadAttention] = {}
    for key in layers:
        if isinstance(key, int):
            if not -len(found) <= key < len(found):
                raise ValueError(f"layer {key} is out of range: the model has {len(found)} attention "
                                 f"modules (0..{len(found) - 1})")
            name, mod = found[key]
            chosen[name] = mod
        else:
            hits = [(n, m) for n, m in found if n == key or fnmatch.fnmatch(n, key)]
            if not hits:
                names = ", ".join(n for n, _ in found[:6]) + (", ..." if len(found) > 6 else "")
                raise ValueError(f"no attention module matches {key!r}; they are named {names}")
            chosen.update(hits)
    return [(n, m) for n, m in found if n in chosen]


def _vit(model: nn.Module) -> nn.Module | None:
    """The first module (maybe `model` itself) that embeds image patches: a ViT or an encoder."""
    return next((m for m in model.modules() if isinstance(getattr(m, "patch_embed", None), PatchEmbed)), None)


def token_layout(model: nn.Module, x: Tensor) -> TokenLayout | None:
    """The token layout a ViT (or a model holding one) gives images `x` (B, C, H, W)."""
    vit = _vit(model)
    if vit is None or x.ndim != 4:
        return None
    gh, gw = vit.patch_embed.check(x)
    return TokenLayout(int(getattr(vit, "num_prefix_tokens", 0)), (gh, gw), vit.patch_embed.patch_size,
                       (int(x.shape[-2]), int(x.shape[-1])))


def available_memory() -> int:
    """Bytes the system reports as available (MemAvailable), or free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def default_max_bytes() -> int:
    return int(DEFAULT_MEMORY_FRACTION * available_memory())


def estimate_bytes(model: nn.Module, x: Tensor, layers=None) -> int:
    """Bytes of float32 weights a capture of `model(x)` will hold for the chosen encoder layers.

    Counts the modules whose token count follows from the images (a ViT's blocks, (B, H, N, N) each);
    decoder modules depend on the text length and are checked as they arrive instead.
    """
    layout = token_layout(model, x)
    if layout is None:
        return 0
    n = layout.num_tokens
    encoder = {id(m) for m in _vit(model).modules()}
    return sum(x.shape[0] * mod.num_heads * n * n * 4
               for _, mod in select_modules(model, layers) if id(mod) in encoder and not mod.cross)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _too_large(need: int, limit: int, what: str, batch: int | None, layers: int) -> CaptureTooLarge:
    per_item = f" ({_fmt(need / batch)} per image)" if batch else ""
    return CaptureTooLarge(
        f"capturing attention {what} needs {_fmt(need)}{per_item} for {layers} layer(s), over the limit "
        f"of {_fmt(limit)} (max_bytes; default {DEFAULT_MEMORY_FRACTION:.0%} of available memory). "
        f"Capture fewer layers (layers=[...]), a smaller batch, or raise max_bytes.")


@contextmanager
def capturing(model: nn.Module, *, layers=None, max_bytes: int | None = None, keep_grad: bool = False,
              to_cpu: bool = True) -> Iterator[AttentionCapture]:
    """Context manager: every forward inside records the chosen modules' attention weights.

    >>> with capturing(model, layers=[0, -1]) as cap:
    ...     model(images)
    >>> cap[0].shape  # (B, H, N, N)

    `keep_grad=True` keeps the weights in the autograd graph (and retains their .grad) for
    gradient-weighted rollout; otherwise they are detached float32 copies (on the CPU if `to_cpu`).
    The `capture` attributes are restored on exit, also after an exception.
    """
    chosen = select_modules(model, layers)
    limit = default_max_bytes() if max_bytes is None else int(max_bytes)
    cap = AttentionCapture(calls={name: [] for name, _ in chosen})
    names = {id(m): n for n, m in chosen}
    used = [0]

    def record(module: nn.Module, weights: Tensor) -> None:
        need = weights.numel() * 4
        if used[0] + need > limit:
            raise _too_large(used[0] + need, limit, "so far", None, len(chosen))
        used[0] += need
        if keep_grad:
            w = weights.float()
            if w.requires_grad:
                w.retain_grad()
        else:
            w = weights.detach().float()
            w = w.cpu() if to_cpu else w.clone()
        cap.calls[names[id(module)]].append(w)

    def remember_layout(_module, args):
        if args and isinstance(args[0], Tensor) and cap.layout is None:
            cap.layout = token_layout(model, args[0])

    saved = [(m, m.capture) for _, m in chosen]
    vit = _vit(model)
    handle = None
    try:
        for _, m in chosen:
            m.capture = record
        if vit is not None:
            handle = vit.patch_embed.register_forward_pre_hook(remember_layout)
        yield cap
    finally:
        for m, old in saved:
            m.capture = old
        if handle is not None:
            handle.remove()


def capture_attention(model: nn.Module, x: Tensor, *, layers: int | str | Sequence[int | str] | None = None,
                      max_bytes: int | None = None, forward_kwargs: dict | None = None) -> AttentionCapture:
    """Run `model(x)` in eval mode without gradients and return every chosen layer's attention.

    `x` (and any tensor in `forward_kwargs`) goes to the device the model's parameters are on, so a model
    on a GPU takes images from the CPU; the weights come back on the CPU, and so does the output.
    Refuses up front (CaptureTooLarge) when the estimate exceeds `max_bytes`. The model's
    train/eval mode is restored afterwards.
    """
    limit = default_max_bytes() if max_bytes is None else int(max_bytes)
    need = estimate_bytes(model, x, layers)
    if need > limit:
        count = len(select_modules(model, layers))
        raise _too_large(need, limit, f"for a batch of {x.shape[0]}", x.shape[0], count)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), capturing(model, layers=layers, max_bytes=limit) as cap:
            cap.layout = token_layout(model, x)
            device = model_device(model, x.device)
            kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in (forward_kwargs or {}).items()}
            out = model(x.to(device), **kwargs)
            cap.output = out.cpu() if isinstance(out, Tensor) else out
    finally:
        model.train(was_training)
    return cap
