#!/usr/bin/env bash
# The two Secrets the Kubernetes manifests (deploy/) refer to by name, made
# outside git (no key is ever committed):
#   kvmesh-mesh-tls  the mesh CA certificate and each role's certificate and
#                    key (ca.pem, <role>.pem, <role>-key.pem; never ca-key.pem),
#                    from the development mesh CA `kvmesh up --mesh-tls` uses
#                    (services/tools/devcerts.py --mesh; kept while valid).
#   kvmesh-api-keys  api-keys.yaml: the gateway's API key file (SHA-256 only;
#                    gateway.api_keys_file, mounted at /etc/kvmesh/api-keys)
#                    for the key in $KVMESH_API_KEY, else a generated one
#                    printed once and kept in <out>/api-key.
#
#   scripts/k8s_secrets.sh [--out DIR] [--namespace NS] [--apply]
#
# Writes DIR (default .run/k8s-secrets, git-ignored): the certificate folder,
# secrets.yaml (Namespace + both Secrets, `kubectl create --dry-run=client`:
# no cluster needed) and a kustomization.yaml, so `kubectl apply -k DIR`
# applies it; --apply does that. Your own CA instead: put its files in
# DIR/mesh-tls (same names, see services/common/mesh_tls.py) before running.
# cert-manager instead: deploy/overlays/cert-manager makes kvmesh-mesh-tls.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.run/k8s-secrets"
NAMESPACE=kvmesh
APPLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --namespace) NAMESPACE="$2"; shift 2 ;;
    --apply) APPLY=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "k8s_secrets.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-$ROOT/.venv/bin/python}"
command -v kubectl >/dev/null || { echo "k8s_secrets.sh: kubectl not found" >&2; exit 2; }

mkdir -p "$OUT"
chmod 700 "$OUT"
TLS="$OUT/mesh-tls"
(cd "$ROOT" && "$PY" -m services.tools.devcerts --mesh --out "$TLS" >/dev/null)

ROLES=(scheduler gateway engine envoy admin)
tls_args=(--from-file="ca.pem=$TLS/ca.pem")
for role in "${ROLES[@]}"; do
  tls_args+=(--from-file="$role.pem=$TLS/$role.pem" --from-file="$role-key.pem=$TLS/$role-key.pem")
done

KEY_FILE="$OUT/api-key"
if [ -n "${KVMESH_API_KEY:-}" ]; then
  key="$KVMESH_API_KEY"
elif [ -s "$KEY_FILE" ]; then
  key="$(cat "$KEY_FILE")"
else
  key="kvm-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(24))')"
  (umask 077 && printf '%s\n' "$key" > "$KEY_FILE")
  echo "generated API key (kept in $KEY_FILE): $key"
fi
digest="$(printf '%s' "$key" | "$PY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
KEYS="$OUT/api-keys.yaml"
(umask 077 && cat > "$KEYS" <<YAML
# The gateway's gateway.api_keys_file (services/gateway/keys.py): entries
# like gateway.api_keys (services/common/config/gateway.py ApiKeyConfig).
api_keys:
  - sha256: $digest
    tenant: default
YAML
)

{
  kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic kvmesh-mesh-tls --namespace "$NAMESPACE" "${tls_args[@]}" \
    --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic kvmesh-api-keys --namespace "$NAMESPACE" \
    --from-file="api-keys.yaml=$KEYS" --dry-run=client -o yaml
} > "$OUT/secrets.yaml"
chmod 600 "$OUT/secrets.yaml"
printf 'resources:\n  - secrets.yaml\n' > "$OUT/kustomization.yaml"
echo "wrote $OUT/secrets.yaml (kvmesh-mesh-tls, kvmesh-api-keys in namespace $NAMESPACE)"

if [ "$APPLY" = 1 ]; then
  kubectl apply -k "$OUT"
fi
