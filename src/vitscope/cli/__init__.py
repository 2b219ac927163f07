"""The `vitscope` command: one module per sub-command, the parser and dispatch in `main`."""

from vitscope.cli.main import UsageError, build_parser, main
from vitscope.cli.train import build_train_config, parse_model_sets

__all__ = ["UsageError", "build_parser", "build_train_config", "main", "parse_model_sets"]
