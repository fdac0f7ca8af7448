#!/usr/bin/env bash
# The whole test suite on a machine with a GPU: first on the GPU (JAX's default backend there),
# then on the same machine's CPU (JAX_PLATFORMS=cpu), each with `pytest -v` so that every
# test's outcome is in the log as it ends and a run cut short still names its failures.
#
#   tools/gpu_suite.sh [OUT_DIR] [-- PYTEST_ARGS...]   (default PYTEST_ARGS: tests)
#
# OUT_DIR (default: $OUT if set, else ./gpu-suite) receives install.log, suite-<backend>.log
# and summary.txt: one line per backend with the JAX version, the devices and the counts
# (passed, failed, errors, skipped), then the failed tests' node ids. Environment:
#   BACKENDS="gpu cpu"  the runs, in order (a "gpu" run on a machine without one is skipped)
#   WORKERS=auto        pytest-xdist's -n (each worker holds its own GPU context)
#   SUITE_TIMEOUT=N     seconds per run: then SIGINT, so pytest still prints its summary
#   PYTHON=python3      the interpreter whose JAX is tested
#   WHEELS=DIR          wheels for what is missing where no index can be reached (default:
#                       .whl/ in the checkout, if there)
#   INSTALL=no          install nothing (what is missing is still listed)
# Installs: the runtime dependencies and pyproject's `test` extra that are not installed,
# with every installed distribution pinned to its version (jax, jaxlib and their CUDA plugins
# are never reinstalled, nor anything else present); paramstore itself with --no-deps, or
# from the checkout through PYTHONPATH. Outside a virtual environment this goes into
# .venv-gpu/, a venv that sees the system's packages (into the system's Python where it
# cannot make one). What cannot be installed (no network,
# no wheel for this Python) is listed in summary.txt; the tests needing it then fail as
# errors (tests/_lazy.py: the oracles are never skipped).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1

OUT_DIR="${OUT:-$ROOT/gpu-suite}"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then OUT_DIR="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || set -- tests
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

export XLA_PYTHON_CLIENT_PREALLOCATE=false # workers share the GPU: each takes what it uses
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # this checkout's paramstore, always

# --- the environment -----------------------------------------------------------------------
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  if [ -x "$ROOT/.venv-gpu/bin/python" ] \
    || "$PY" -m venv --system-site-packages "$ROOT/.venv-gpu" >/dev/null 2>&1; then
    PY="$ROOT/.venv-gpu/bin/python"
  else # no venv module here: the system's Python itself (what is there stays pinned)
    export PIP_BREAK_SYSTEM_PACKAGES=1
  fi
fi
"$PY" -c 'import jax' || { echo "no JAX for $PY: install jax first (this script never does)"; exit 1; }

# What pyproject asks for (runtime and `test` extra) that is not installed in a satisfying
# version, one requirement a line; and constraints pinning every installed distribution.
missing() {
  "$PY" - "$1" <<'EOF'
import importlib.metadata as md, sys, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = {}
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if name and name != "paramstore":
        pins[name] = dist.version
open(sys.argv[1], "w").write("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
for text in project["dependencies"] + project["optional-dependencies"]["test"]:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate():
        continue
    have = pins.get(req.name.lower().replace("_", "-"))
    if have is None:
        print(text)
    elif not req.specifier.contains(have, prereleases=True):
        print(f"{text}  # installed: {have}, left as it is")
EOF
}

CONSTRAINTS="$OUT_DIR/constraints.txt"
PIP=("$PY" -m pip install --retries 0 --timeout 15 -c "$CONSTRAINTS")
WHEELS="${WHEELS:-$ROOT/.whl}"
[ -d "$WHEELS" ] && PIP+=(--find-links "$WHEELS")
if [ "${INSTALL:-yes}" != no ]; then
  {
    echo "# $(date -u +%FT%TZ) $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    mapfile -t WANT < <(missing "$CONSTRAINTS" | grep -v '  # installed')
    if [ ${#WANT[@]} -gt 0 ]; then
      echo "# missing: ${WANT[*]}"
      # all at once; where that fails (one cannot be had), each on its own
      "${PIP[@]}" "${WANT[@]}" || for req in "${WANT[@]}"; do "${PIP[@]}" "$req"; done
    fi
    "$PY" -m pip install --no-deps --no-build-isolation -e . \
      || echo "# paramstore not installed: imported from $ROOT through PYTHONPATH"
  } >"$OUT_DIR/install.log" 2>&1
fi
mapfile -t STILL < <(missing "$OUT_DIR/installed.txt")
if [ ${#STILL[@]} -gt 0 ]; then
  echo "not as pyproject asks (tests needing a missing one fail as errors): $(IFS=';'; echo "${STILL[*]}")" \
    | tee -a "$SUMMARY"
fi

# --- the runs --------------------------------------------------------------------------------
count() { # LOG STATUS SECONDS -> "N passed, N failed, N errors, N skipped ..." from the log
  "$PY" - "$@" <<'EOF'
import re, sys
log, status, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3]
text = open(log, errors="replace").read()
final = re.findall(r"^=+ (.*\b(?:passed|failed|error|errors|skipped|deselected)\b.*) in [\d.]+s.*=+$", text, re.M)
# each test's -v line (with or without xdist's "[gwN] [ p%] " prefix) before the short summary
body = re.split(r"^=+ short test summary info =+$", text, maxsplit=1, flags=re.M)[0]
seen = {}
WORDS = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
for m in re.finditer(rf"(?:^|\] )({WORDS}) (\S+\.py\S*)|^(\S+\.py::\S+) ({WORDS})\b", body, re.M):
    word = m.group(1) or m.group(4)
    seen.setdefault(word, []).append(m.group(2) or m.group(3))
counted = ", ".join(f"{len(seen.get(w, []))} {w.lower()}" for w in ("PASSED", "FAILED", "ERROR", "SKIPPED")) + "".join(
    f", {len(seen[w])} {w.lower()}" for w in ("XFAIL", "XPASS") if w in seen)
cut = "" if final else " (cut short: counted from the -v lines)"
if "KeyboardInterrupt" in text or "!!! Interrupted" in text:
    cut += " (interrupted)"
print(f"{final[-1] if final else counted}; exit {status}; {seconds} s{cut}")
for word in ("FAILED", "ERROR"):
    for node in seen.get(word, []):
        print(f"  {word} {node}")
EOF
}

WORKERS="${WORKERS:-auto}"
XDIST=()
"$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n "$WORKERS")
overall=0
for backend in ${BACKENDS:-gpu cpu}; do
  log="$OUT_DIR/suite-$backend.log"
  if [ "$backend" = cpu ]; then
    envs=(env JAX_PLATFORMS=cpu)
  else
    envs=(env -u JAX_PLATFORMS) # JAX's own choice: the GPU where there is one
  fi
  info="$("${envs[@]}" "$PY" -c 'import jax; d = jax.devices(); print(jax.default_backend(), f"jax {jax.__version__}, {len(d)} x {d[0].device_kind}")' 2>&1 | tail -n 1)"
  if [ "$backend" != cpu ] && [ "${info%% *}" != gpu ]; then
    echo "$backend: skipped, no GPU backend here ($info)" | tee -a "$SUMMARY"
    continue
  fi
  info="${info#* }"
  echo "== $backend: $info; log: $log"
  limit=()
  [ -n "${SUITE_TIMEOUT:-}" ] && limit=(timeout --signal=INT --kill-after=60 "$SUITE_TIMEOUT")
  start=$SECONDS
  "${envs[@]}" "${limit[@]}" "$PY" -m pytest -v -rfE -p no:cacheprovider "${XDIST[@]}" "$@" \
    >"$log" 2>&1
  status=$?
  [ "$status" -eq 0 ] || overall=1
  { echo "$backend ($info): $(count "$log" "$status" $((SECONDS - start)))"; } | tee -a "$SUMMARY"
done
exit "$overall"
