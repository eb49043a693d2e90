# Sourced by the bin/ scripts, not run: set everything up (bin/setup, idempotent), then work
# from the repository with its virtual environment first on PATH. Sets ROOT and VENV.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/bin/setup"
VENV="${HEPTI_VENV:-$ROOT/.venv}"
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
