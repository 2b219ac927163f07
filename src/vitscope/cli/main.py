"""`vitscope train | eval | predict | explain | caption | translate | bench | data | models`: one module per
sub-command, each with one parser and one run function; this one builds the parser and runs the command.

Errors a user can fix (a wrong flag value, a missing file, a mismatched checkpoint) print one line
and exit with code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from vitscope.cli.bench import add_bench_parser
from vitscope.cli.caption import add_caption_parser
from vitscope.cli.common import EXIT_USAGE, Parser, os_error_line
from vitscope.cli.data import add_data_parser
from vitscope.cli.eval import add_eval_parser
from vitscope.cli.explain import add_explain_parser
from vitscope.cli.models import add_models_parser
from vitscope.cli.predict import add_predict_parser
from vitscope.cli.train import add_train_parser
from vitscope.cli.translate import add_translate_parser
from vitscope.errors import VitscopeError

DESCRIPTION = ("Attention and Vision Transformers from first principles: train a classifier, a captioner or a "
               "translator, evaluate it, use it on your images or sentences, and see what its attention learned. "
               "`vitscope COMMAND --help` tells each command's flags.")


def build_parser() -> Parser:
    parser = Parser(prog="vitscope", description=DESCRIPTION)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (add_train_parser, add_eval_parser, add_predict_parser, add_explain_parser, add_caption_parser,
                add_translate_parser, add_bench_parser, add_data_parser, add_models_parser):
        add(sub)
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


def main(argv: list[str] | None = None) -> int:
    from vitscope.kernels import allocator

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # a flag's value was refused (one line printed); --help still exits
        if e.code == EXIT_USAGE:
            return EXIT_USAGE
        raise
    _plain_warnings(f"vitscope {args.command}")
    from vitscope.kernels.native import bad_isa_cap

    if (bad_cap := bad_isa_cap()):  # a mistyped cap would turn every kernel off without a word
        print(f"vitscope {args.command}: error: {bad_cap}", file=sys.stderr)
        return EXIT_USAGE
    if args.command in ("eval", "predict", "explain", "caption", "translate"):
        # the forwards reuse freed memory instead of having the kernel fault it in again: CPU inference
        # ran 1.2-1.8x as fast (docs/performance.md); `vitscope train --keep-freed-memory true` asks for it
        allocator.keep_freed_memory()
    try:
        return args.run(args)
    # What the user gave (VitscopeError), the system's answer on the user's paths (OSError) and running out of
    # memory at the user's sizes are one line; anything else is a bug in vitscope and keeps its traceback.
    except (VitscopeError, OSError, MemoryError) as e:
        if args.debug:
            raise
        if isinstance(e, OSError) and e.errno is not None:  # the system's, not one of vitscope's messages
            msg = os_error_line(e)
        elif isinstance(e, MemoryError) and not isinstance(e, VitscopeError):
            msg = f"out of memory{': ' + str(e) if str(e) else ''}; use a smaller --batch-size or --image-size"
        else:
            msg = str(e).strip() or type(e).__name__
        msg = "; ".join(line.strip() for line in msg.splitlines() if line.strip())  # one line
        print(f"vitscope {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    # torch's allocator says "can't allocate memory" in a RuntimeError of its own (after VitscopeError: a NaN
    # loss, NonFiniteLoss, is both)
    except RuntimeError as e:
        if args.debug or not _out_of_memory(e):
            raise
        print(f"vitscope {args.command}: error: {_out_of_memory(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"vitscope {args.command}: interrupted", file=sys.stderr)
        return 130


def _out_of_memory(e: RuntimeError) -> str | None:
    """torch's refusal to allocate (CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate N
    bytes"; CUDA: torch.OutOfMemoryError) as one line, or None for any other RuntimeError (a bug: traceback)."""
    import re

    text = str(e)
    if not re.search(r"can't allocate memory|not enough memory|out of memory", text, re.IGNORECASE):
        return None
    size = re.search(r"allocate (\d+) bytes", text)
    asked = f" (a tensor of {int(size.group(1)) / 2**30:,.1f} GiB)" if size else ""
    return (f"out of memory{asked}: the model or a batch is larger than this machine holds; choose smaller "
            f"sizes (--batch-size, --image-size, the model's --set fields)")


if __name__ == "__main__":
    sys.exit(main())
