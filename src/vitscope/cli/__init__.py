"""The `vitscope` command: one module per sub-command, the parser and dispatch in `main`."""

from vitscope.cli.common import UsageError, parse_model_sets
from vitscope.cli.main import build_parser, main
from vitscope.cli.train import build_train_config

__all__ = ["UsageError", "build_parser", "build_train_config", "main", "parse_model_sets"]
