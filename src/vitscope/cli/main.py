"""`vitscope train | eval | predict | explain | caption | bench | data | models`: one parser and one run function
each (data and models here; the others in their own modules), and what the sub-commands share.

Errors a user can fix (a wrong flag value, a missing file, a mismatched checkpoint) print one line
and exit with code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
import warnings
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """A problem the user can fix; printed as one line."""


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


# -- shared helpers ---------------------------------------------------------------------------------
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


def _shown(value) -> str:
    """A default as its flag takes it: none, true/false, numbers separated by spaces."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return " ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, prefix: str = "", dest_prefix: str = "",
                        defaults=None) -> None:
    """One flag per dataclass field (`--lr`, `--aug-policy`, ...), defaulting to 'not given'. Each flag's
    help is its field's `metadata["help"]`, with the field's value in `defaults` (an instance of `cls`:
    what the flag's absence leaves), or else the field's own default."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, choices, optional = _field_type(hints[f.name])
        flag = "--" + prefix + f.name.replace("_", "-")
        dest = dest_prefix + f.name
        if kind is None:
            continue
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        text = f.metadata.get("help", "")
        text = f"{text} (default: {_shown(default)})" if text else f"default: {_shown(default)}"
        text = text.replace("%", "%%")  # argparse formats help with %
        if kind == "tuple":
            parser.add_argument(flag, dest=dest, type=float, nargs="+", default=None, metavar="X", help=text)
        elif kind is bool:
            parser.add_argument(flag, dest=dest, type=_bool, default=None, metavar="{true,false}", help=text)
        else:
            parser.add_argument(flag, dest=dest, type=_none_or(kind) if optional else kind, choices=choices,
                                default=None, metavar="none|" + kind.__name__ if optional else None, help=text)


# -- what several sub-commands share ------------------------------------------------------------------
def add_kernels_flag(parser: argparse.ArgumentParser) -> None:
    """--no-kernels: PyTorch's ops alone, for a command that otherwise swaps vitscope's CPU kernels in."""
    parser.add_argument("--no-kernels", action="store_true",
                        help="run PyTorch's ops alone, without vitscope's CPU kernels (VITSCOPE_NATIVE=0 keeps "
                             "the C kernels from loading at all)")


def check_out_dir(path: Path) -> Path:
    """Before any work: `path` can be an output folder (no file in its place, somewhere writable)."""
    from vitscope.training.run_dir import RunDirError, _not_a_file, probe_writable

    try:
        _not_a_file(path)
        probe_writable(path)
    except RunDirError as e:
        raise UsageError(str(e)) from None
    return path


def listed(names, most: int = 4) -> str:
    names = list(names)
    return ", ".join(map(str, names[:most])) + (f", ... {len(names)} in all" if len(names) > most else "")


# -- data --------------------------------------------------------------------------------------------
def add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="list, verify or prepare datasets",
                       description="list: the datasets vitscope reads; verify NAME: check files (counts, shapes, "
                                   "checksums); prepare NAME: find or download and verify.")
    p.add_argument("action", choices=["list", "verify", "prepare"])
    p.add_argument("name", nargs="?", default="fashion_mnist")
    p.add_argument("--root", help="where the dataset's files are")
    p.set_defaults(run=run_data)


def run_data(args) -> int:
    from vitscope.data import list_datasets, load_dataset, verify_dataset

    if args.action == "list":
        for name in list_datasets():
            print(name)
        return 0
    if args.action == "prepare":
        for split in ("train", "test"):
            ds = load_dataset(args.name, split, root=args.root)
            print(f"{args.name} {split}: {len(ds)} images of {tuple(ds.images.shape[1:])}, {len(ds.classes)} classes")
    for line in verify_dataset(args.name, args.root):
        print(line)
    return 0


# -- models ------------------------------------------------------------------------------------------
def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="the model presets with their parameter counts and pretrained weights")
    p.add_argument("pattern", nargs="?", default="*", help="glob over names, e.g. 'vit_*28'")
    p.set_defaults(run=run_models)


def run_models(args) -> int:
    import torch

    from vitscope.models import create_model, get_config, list_models
    from vitscope.weights.pretrained import TIMM_WEIGHTS

    names = list_models(args.pattern)
    if not names:
        raise UsageError(f"no preset matches {args.pattern!r}")
    print(f"{'name':<26} {'params':>12}  {'image':>9}  {'patch':>5}  {'width':>5}  {'depth':>5}  {'heads':>5}  "
          f"pretrained")
    for n in names:
        cfg = get_config(n)
        with torch.device("meta"):
            params = create_model(n).num_params()
        size = cfg.img_size if isinstance(cfg.img_size, int) else "x".join(map(str, cfg.img_size))
        weights = TIMM_WEIGHTS.get(n, "")  # `create_model(name, pretrained=True)`, `train --pretrained true`
        print(f"{n:<26} {params:>12,}  {size!s:>9}  {cfg.patch_size:>5}  {cfg.embed_dim:>5}  {cfg.depth:>5}  "
              f"{cfg.num_heads:>5}  {'timm ' + weights.split('.', 1)[1] if weights else ''}".rstrip())
    return 0


# -- main --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="vitscope", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from vitscope.cli.caption import add_caption_parser
    from vitscope.cli.eval import add_eval_parser
    from vitscope.cli.train import add_train_parser

    add_train_parser(sub)
    from vitscope.cli.predict import add_predict_parser

    add_eval_parser(sub)
    add_predict_parser(sub)
    from vitscope.cli.explain import add_explain_parser

    add_explain_parser(sub)
    add_caption_parser(sub)
    from vitscope.cli.bench import add_bench_parser

    add_bench_parser(sub)
    add_data_parser(sub)
    add_models_parser(sub)
    return parser


_PYTHON_FORMATWARNING = warnings.formatwarning


def _plain_warnings(prog: str) -> None:
    """vitscope's own warnings (skipped files and the like) as `vitscope train: warning: ...` lines, without
    the source line Python's format adds; other libraries' warnings keep their file and line."""
    package = str(Path(__file__).resolve().parents[1])  # the whole vitscope package

    def formatwarning(message, category, filename, lineno, line=None):
        if str(Path(filename).resolve()).startswith(package):
            return f"{prog}: warning: {message}\n"
        return _PYTHON_FORMATWARNING(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


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


def main(argv: list[str] | None = None) -> int:
    from vitscope.data import DataError
    from vitscope.kernels import allocator
    from vitscope.training.checkpointing import CheckpointError
    from vitscope.training.loop import NonFiniteLoss
    from vitscope.training.run_dir import RunDirError
    from vitscope.weights.pretrained import WeightsError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a flag's value was refused (one line printed); --help still exits
        if e.code == EXIT_USAGE:
            return EXIT_USAGE
        raise
    _plain_warnings(f"vitscope {args.command}")
    if args.command in ("eval", "predict", "explain"):
        # the forwards reuse freed memory instead of having the kernel fault it in again: CPU inference
        # ran 1.2-1.8x as fast (RESULTS.md); `vitscope train --keep-freed-memory true` asks for it
        allocator.keep_freed_memory()
    try:
        return args.run(args)
    except (UsageError, DataError, NonFiniteLoss, WeightsError, ValueError, KeyError, CheckpointError, RunDirError,
            OSError, MemoryError) as e:
        if args.debug:
            raise
        if isinstance(e, OSError) and e.errno is not None:  # the system's, not one of vitscope's messages
            msg = os_error_line(e)
        elif isinstance(e, MemoryError):
            msg = f"out of memory{': ' + str(e) if str(e) else ''}; use a smaller --batch-size or --image-size"
        else:
            # a KeyError's str() is its key's repr; other messages keep their quotes
            msg = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip() or type(e).__name__
        msg = "; ".join(line.strip() for line in msg.splitlines() if line.strip())  # one line
        print(f"vitscope {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
