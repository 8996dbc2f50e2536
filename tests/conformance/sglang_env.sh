#!/usr/bin/env bash
# Makes the SGLang venv the conformance suite runs SGLang's own KV-event code in:
# sglang==0.5.23 without its dependencies (no torch, no kernels) and the few packages its
# kv_events module imports (tests/conformance/sglang-requirements.txt says which and why).
#
# Cached and idempotent like vllm_env.sh: the venv lives under
# ${XDG_CACHE_HOME:-~/.cache}/kvindex/, named by a digest of this script and the
# requirements; .venv-sglang in the checkout links to it (git-ignored).
# $KVTEST_SGLANG_VENV puts it somewhere else. Prints the interpreter's path on its last
# line (KVTEST_SGLANG_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/../.."

sglang_version=0.5.23
requirements=tests/conformance/sglang-requirements.txt
digest="$(cat "$requirements" "$0" | sha256sum | cut -c1-12)"
venv="${KVTEST_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvindex/venv-sglang-$sglang_version-$digest}"
stamp="$venv/.kvindex-sglang-env"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ]; then
  echo "sglang_env: reusing $venv" >&2
else
  echo "sglang_env: building $venv (sglang $sglang_version, no dependencies)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    "sglang==$sglang_version" -r "$requirements"
  # SGLang's own classes must load as the driver loads them; only then is it complete.
  "$venv/bin/python" tests/conformance/sglang_driver.py --check "$sglang_version"
  echo "$digest" > "$stamp"
fi
if [ -z "${KVTEST_SGLANG_VENV:-}" ] && { [ -L .venv-sglang ] || [ ! -e .venv-sglang ]; }; then
  ln -sfn "$venv" .venv-sglang
fi
echo "$(cd "$venv" && pwd)/bin/python"
