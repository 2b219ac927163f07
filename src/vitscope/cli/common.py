"""What the sub-commands share: the one-line usage error, argparse types, one flag per dataclass field,
the kernels flag, the output-folder check, the decoding options, and OS errors as one line.

Every sub-command module imports from here and `main` imports the sub-commands, so the imports run one way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from vitscope.errors import VitscopeError

EXIT_USAGE = 2


class UsageError(VitscopeError):
    """A problem the user can fix in the command line; printed as one line."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (`vitscope eval: error: ...`) and exit code 2, like vitscope's own."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help lists the options)\n")


def at_least(low: int):
    """An argparse type: a whole number >= `low`."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    parse.__name__ = "int"
    return parse


# -- one flag per dataclass field ---------------------------------------------------------------------
def _field_type(tp):
    """(scalar type argparse should parse a dataclass field with, its choices, whether None is allowed)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return str, list(args), False
    if type(None) in args:
        kind, choices, _ = _field_type(next(a for a in args if a is not type(None)))
        return kind, choices, True
    if origin is tuple:
        return "tuple", None, False
    if tp in (int, float, str, bool):
        return tp, None, False
    return None, None, False


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


class _NoneGiven:
    """What `--flag none` parses to: None itself would read as 'flag not given' and keep the preset's value."""

    def __repr__(self) -> str:
        return "none"


NONE_GIVEN = _NoneGiven()


def given_value(value):
    """A parsed flag's value for the config: `--flag none` -> None."""
    return None if value is NONE_GIVEN else value


def _none_or(kind):
    def parse(s: str):
        return NONE_GIVEN if s.lower() == "none" else kind(s)
    parse.__name__ = kind.__name__
    return parse


def _field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def shown(value) -> str:
    """A default as its flag takes it: none, true/false, numbers separated by spaces."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return " ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


def inline_options(cls) -> dict[str, type]:
    """`cls`'s fields whose own fields are flags of their own (`metadata["flags"] == "inline"`: TrainConfig's
    task options), by name -> their dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: next(a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a))
            for f in dataclasses.fields(cls) if f.metadata.get("flags") == "inline"}


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, prefix: str = "", dest_prefix: str = "",
                        defaults=None, _added: set[str] | None = None) -> None:
    """One flag per dataclass field (`--lr`, `--aug-policy`, ...), defaulting to 'not given'. Each flag's
    help is its field's `metadata["help"]`, with the field's value in `defaults` (an instance of `cls`:
    what the flag's absence leaves), or else the field's own default. A field marked inline (`inline_options`)
    gives its own fields' flags in its place, by their own names; a name two of them share is one flag."""
    hints = typing.get_type_hints(cls)
    added = set() if _added is None else _added
    inline = inline_options(cls)
    for f in dataclasses.fields(cls):
        if f.name in inline:
            own = getattr(defaults, f.name, None) if defaults is not None else None
            add_dataclass_flags(parser, inline[f.name], prefix, dest_prefix, own, added)
            continue
        kind, choices, optional = _field_type(hints[f.name])
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = dest_prefix + f.name
        if kind is None or dest in added:
            continue
        added.add(dest)
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        text = f.metadata.get("help", "")
        text = f"{text} (default: {shown(default)})" if text else f"default: {shown(default)}"
        text = text.replace("%", "%%")  # argparse formats help with %
        if kind == "tuple":
            parser.add_argument(flag, dest=dest, type=float, nargs="+", default=None, metavar="X", help=text)
        elif kind is bool:
            parser.add_argument(flag, dest=dest, type=_bool, default=None, metavar="{true,false}", help=text)
        else:
            parser.add_argument(flag, dest=dest, type=_none_or(kind) if optional else kind, choices=choices,
                                default=None, metavar="none|" + kind.__name__ if optional else None, help=text)


def nonempty_path(text: str) -> Path:
    """A path flag's value: an empty one (`--out ""`) would be the current folder, which no one means."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a folder")
    return Path(text)


def parse_model_sets(items: list[str]) -> dict:
    """`--set FIELD=VALUE` items as model fields: JSON values, plain strings staying strings, e.g.
    ['depth=3', 'stem=[[32,1]]'] -> {'depth': 3, 'stem': [[32, 1]]}. Unknown fields are a UsageError."""
    from vitscope.vit import ViTConfig

    model_fields = {f.name for f in dataclasses.fields(ViTConfig)}
    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--set takes FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        if k not in model_fields:
            raise UsageError(f"--set {k}: not a model field; choose from {', '.join(sorted(model_fields))}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


# -- what several sub-commands share ------------------------------------------------------------------
def add_kernels_flag(parser: argparse.ArgumentParser) -> None:
    """--kernels {true,false}, spelled as `vitscope train` spells its TrainConfig field: false runs PyTorch's ops
    alone, for a command that otherwise swaps vitscope's CPU kernels in."""
    parser.add_argument("--kernels", type=_bool, default=True, metavar="{true,false}",
                        help="CPU: run vitscope's kernels (vitscope.kernels.apply); false: PyTorch's ops alone "
                             "(VITSCOPE_NATIVE=0 keeps the C kernels from loading at all) (default: true)")


def check_out_dir(path: Path, *, writes: tuple[str, ...] = (), overwrite: bool = False) -> Path:
    """Before any work: `path` can be an output folder (no file in its place, somewhere writable), and the files
    `writes` names do not replace a training run's own files there unless `overwrite`."""
    from vitscope.training.run_dir import RUN_MARKERS, RunDirError, _not_a_file, probe_writable

    try:
        _not_a_file(path)
        probe_writable(path)
    except RunDirError as e:
        raise UsageError(str(e)) from None
    taken = [name for name in writes if (path / name).exists()]
    if taken and not overwrite and any((path / m).exists() for m in RUN_MARKERS):
        raise UsageError(f"{path} is a training run's folder and holds {listed(taken)}, which this command would "
                         f"replace; give another --out, or pass --overwrite to replace them")
    return path


def add_overwrite_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace files of the same names in --out even where it is a training run's folder")


def listed(names, most: int = 4) -> str:
    names = list(names)
    return ", ".join(map(str, names[:most])) + (f", ... {len(names)} in all" if len(names) > most else "")


def os_error_line(e: OSError) -> str:
    """An OSError on a user's path as one line: what happened, where, and what to do."""
    import errno

    where = f": {e.filename}" if e.filename else ""
    if e.filename2:
        where += f" -> {e.filename2}"
    advice = {
        errno.ENOSPC: "free some disk space or write elsewhere",
        errno.EDQUOT: "free some space or write elsewhere",
        errno.EACCES: "choose a folder you can write to, or change its permissions",
        errno.EPERM: "choose a folder you can write to, or change its permissions",
        errno.EROFS: "the file system is read-only: write elsewhere",
        errno.ENOTDIR: "a file stands where a folder should be: choose another path",
        errno.EEXIST: "a file stands where a folder should be: choose another path",
        errno.EISDIR: "a folder stands where a file should be: choose another path",
        errno.ENOENT: "check the path",
    }.get(e.errno, "check the path")
    return f"{e.strerror or type(e).__name__}{where}; {advice}"


# -- decoding: what `caption`, `translate` and `eval` share -----------------------------------------------
def add_decoding_options(p: argparse.ArgumentParser, *, beam_default: int, vocab: bool = True) -> None:
    """The decoding options `caption`, `translate` and `eval` share (`decode_options` reads them), and a
    captioner's --vocab."""
    p.add_argument("--beam", type=at_least(1), default=beam_default,
                   help=f"beam size; 1 decodes greedily (default: {beam_default})")
    p.add_argument("--max-len", type=at_least(2), default=None, metavar="N",
                   help="the longest output in tokens, <bos> and <eos> included (default: the decoder's positions)")
    p.add_argument("--length-penalty", type=float, default=0.0,
                   help="rank beams by log-probability / length ** this (default: 0, the summed log-probability)")
    p.add_argument("--no-repeat-ngram", type=at_least(0), default=0, metavar="N",
                   help="never repeat an n-gram of this size (default: 0, off)")
    if vocab:
        p.add_argument("--vocab", type=Path, metavar="FILE",
                       help="captioning: a vocabulary JSON file to use instead of the checkpoint's own (it must be "
                            "the same)")


def decode_options(args):
    """The decoding flags as one `vitscope.sequence.DecodeOptions`, checked."""
    from vitscope.sequence.decoding import DecodeOptions

    return DecodeOptions(beam=args.beam, max_len=args.max_len, length_penalty=args.length_penalty,
                         no_repeat_ngram_size=args.no_repeat_ngram)


def open_caption_run(model: str | Path, *, vocab: Path | None, options, kernels: bool):
    """A captioning run opened for decoding with `options` (DecodeOptions), or a usage error that says which
    command fits `model` instead."""
    from vitscope.caption.run import is_caption_checkpoint, open_captioner

    if not is_caption_checkpoint(model):
        if not Path(model).exists():
            raise UsageError(f"no run directory or checkpoint at {model}")
        raise UsageError(f"{model} is not a captioning run; train one with vitscope train --task caption "
                         f"(for a classifier use vitscope predict)")
    run = open_captioner(model, vocab_file=vocab, kernels=kernels)
    options.check(run.model)
    return run
