#!/usr/bin/env bash
# Idempotent set-up shared by `make run`, `make test` and `make docs`: a virtual environment with the pinned
# development versions, Fashion-MNIST from Debian's package, and (for the tests) Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-run}
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# `make docs` also needs the site's tools; each set of extras keeps its own stamp.
extras=test
[ "$what" = docs ] && extras=test,docs
stamp=.venv/.setup-stamp
[ "$extras" = test ] || stamp=".venv/.setup-stamp-${extras/,/-}"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import vitscope" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  echo "$want" > "$stamp"
fi

apt_install() {
  # Debian packages need root; without it, say what to run and go on.
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "note: not root or no apt-get; install $* yourself for the full set-up" >&2
    return 0
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 ||
      echo "note: apt-get could not install $*" >&2
  }
}

# Fashion-MNIST: Debian's package if we can; otherwise vitscope downloads the official files.
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || apt_install dataset-fashion-mnist
if [ "$what" = test ]; then
  command -v chromium >/dev/null || apt_install chromium
fi
