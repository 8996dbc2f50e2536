#!/usr/bin/env bash
# Makes the vLLM venv the conformance suite runs vLLM's own code in (default .venv-vllm,
# or $KVINDEX_VLLM_VENV): a CPU torch, vllm==0.33.0 without its dependencies (no CUDA
# kernels, no model is ever loaded) and the packages its engine-core modules import
# (tests/conformance/vllm-requirements.txt says which and why). Idempotent: a venv made
# from the same requirements and working is reused in a second; anything else is rebuilt.
# Prints the interpreter's path on its last line (export it as KVINDEX_VLLM_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${KVINDEX_VLLM_VENV:-.venv-vllm}"
requirements=tests/conformance/vllm-requirements.txt
vllm_version=0.33.0
torch_version=2.13.0  # this machine kind carries its CPU build in the local wheel dir
stamp="$venv/.kvindex-vllm-env"
want="$(cat "$requirements" "$0" | sha256sum | cut -c1-16)"

works() {
  "$venv/bin/python" - "$vllm_version" <<'PY' >/dev/null 2>&1
import sys
import vllm
import vllm.distributed.kv_events, vllm.lora.request, vllm.v1.core.kv_cache_manager  # noqa
assert vllm.__version__ == sys.argv[1], vllm.__version__
PY
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && works; then
  echo "vllm_env: reusing $venv (vllm $vllm_version)" >&2
else
  echo "vllm_env: building $venv (torch $torch_version, vllm $vllm_version; a few minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "vllm==$vllm_version" -r "$requirements"
  works || { echo "vllm_env: $venv cannot import vLLM's engine core" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
echo "$(cd "$venv" && pwd)/bin/python"
