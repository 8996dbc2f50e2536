#!/usr/bin/env bash
# Makes the vLLM venv the conformance suite runs vLLM's own code in: a CPU torch,
# vllm==0.33.0 without its dependencies (no CUDA kernels, no model is ever loaded) and
# the packages its engine-core modules import (tests/conformance/vllm-requirements.txt
# says which and why).
#
# Cached and idempotent: the venv lives outside the checkout, under
# ${XDG_CACHE_HOME:-~/.cache}/kvindex/, named by a digest of this script and the
# requirements, so every clone on the machine (CI's fresh ones too) reuses it at once;
# .venv-vllm in the checkout links to it (git-ignored). $KVTEST_VLLM_VENV puts the venv
# somewhere else. A venv that is incomplete or was made from other requirements is never
# reused. Prints the interpreter's path on its last line (KVTEST_VLLM_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/../.."

vllm_version=0.33.0
torch_version=2.13.0  # this machine kind carries its CPU build in the local wheel dir
requirements=tests/conformance/vllm-requirements.txt
digest="$(cat "$requirements" "$0" | sha256sum | cut -c1-12)"
venv="${KVTEST_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvindex/venv-vllm-$vllm_version-$digest}"
stamp="$venv/.kvindex-vllm-env"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  echo "vllm_env: reusing $venv" >&2
else
  echo "vllm_env: building $venv (torch $torch_version, vllm $vllm_version; a few minutes)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "vllm==$vllm_version" -r "$requirements"
  # The modules the driver imports must import; only then is the venv marked complete.
  "$venv/bin/python" - "$vllm_version" <<'PY'
import sys

import vllm
import vllm.distributed.kv_events  # noqa: F401
import vllm.lora.request  # noqa: F401
import vllm.v1.core.kv_cache_manager  # noqa: F401

assert vllm.__version__ == sys.argv[1], vllm.__version__
PY
  echo "$digest" > "$stamp"
fi
if [ -z "${KVTEST_VLLM_VENV:-}" ] && { [ -L .venv-vllm ] || [ ! -e .venv-vllm ]; }; then
  ln -sfn "$venv" .venv-vllm
fi
echo "$(cd "$venv" && pwd)/bin/python"
