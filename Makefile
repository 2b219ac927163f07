# The README's two commands. Both set everything up first and can be run again safely.
.PHONY: run test test-slow lint bench docs

# runs/fmnist_quick is this command's own folder: each `make run` trains it afresh (--overwrite), so
# running it again gives the same run; train with another --out to keep one.
run:
	@./scripts/setup.sh run
	.venv/bin/vitscope train --preset fmnist_quick --out runs/fmnist_quick --overwrite

test:
	@./scripts/setup.sh test
	.venv/bin/python -m pytest -q
	@./scripts/test-every-isa.sh

# The tests marked slow (the benchmark scripts' longer smoke runs); CI runs them after `make test`.
test-slow:
	@./scripts/setup.sh test
	.venv/bin/python -m pytest -q -m slow
	@./scripts/test-every-isa.sh -m slow

lint:
	.venv/bin/ruff check .

bench:
	.venv/bin/python benchmarks/bench_attention.py

# The documentation site, into site/: offline, warnings are errors, and the tutorials executed as they are
# built (a few minutes on 2 cores). VITSCOPE_DOCS_EXECUTE=false renders them without running them.
docs:
	@./scripts/setup.sh docs
	.venv/bin/mkdocs build --strict
