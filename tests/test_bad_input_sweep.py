"""scripts/bad_input_sweep.py in its quick mode: a seeded sample of its bad-input cases (each a `vitscope`
subprocess that must refuse in one line, exit 2, leave no temporary file and lose nothing of a run) passes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bad_input_sweep.py"


def _sweep():
    spec = importlib.util.spec_from_file_location("bad_input_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bad_input_sweep", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_sweep_generates_a_few_hundred_cases_of_every_kind(capsys):
    assert _sweep().main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kinds = {line.split(":")[0] for line in lines[:-1]}
    assert int(lines[-1].split()[0]) >= 300
    assert {"train-field", "model-field", "decoder-field", "augment-field", "image-file", "damaged-run",
            "caption-file", "hostile-path", "existing-run", "write-failure", "env", "interrupt", "damaged-metadata",
            "impossible-setting", "translate-note", "empty-caption", "linked-folder", "message"} <= kinds


@pytest.mark.slow
def test_a_quick_sample_of_the_sweep_passes(capsys):
    code = _sweep().main(["--quick", "--sample", "8", "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tried 8, passed 8, failed 0" in out
