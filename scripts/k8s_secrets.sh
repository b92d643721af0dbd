#!/usr/bin/env bash
# The Secrets the Kubernetes manifests (deploy/) refer to by name, made
# outside git (no key is ever committed):
#   kvmesh-mesh-tls  the mesh CA certificate and each pod role's certificate
#                    and key (ca.pem, <role>.pem, <role>-key.pem; never
#                    ca-key.pem, nor the operator's admin pair),
#                    from the development mesh CA `kvmesh up --mesh-tls` uses
#                    (services/tools/devcerts.py --mesh; kept while valid).
#   kvmesh-api-keys  api-keys.yaml: the gateway's API key file (SHA-256 only;
#                    gateway.api_keys_file, mounted at /etc/kvmesh/api-keys)
#                    for the key in $KVMESH_API_KEY, else a generated one
#                    printed once and kept in <out>/api-key.
#   kvmesh-admin-keys admin-keys.yaml: the scheduler's admin key file (SHA-256
#                    only; scheduler.admin_keys_file, mounted at
#                    /etc/kvmesh/admin-keys) for the token in
#                    $KVMESH_ADMIN_TOKEN, else a generated one printed once
#                    and kept in <out>/admin-token; holder name
#                    $KVMESH_ADMIN_NAME (default operator).
#   kvmesh-batch-key internal-key: the batch service's internal credential
#                    (batch.internal_key_file, mounted at /etc/kvmesh/batch-key
#                    in the batch pod and the gateways, which accept a batch
#                    line's headers only with it): $KVMESH_BATCH_INTERNAL_KEY,
#                    else a generated one kept in <out>/batch-internal-key
#                    (never printed: nothing but the two services uses it).
# Also <out>/operator.yaml: the config `kvmesh admin` / `kvmesh top` use on
# the operator's machine through `kubectl port-forward` (scheduler on
# 127.0.0.1:50051 + 9101, mesh TLS with the `admin` certificate of
# <out>/mesh-tls; deploy/README.md "Operate it").
#
#   scripts/k8s_secrets.sh [--out DIR] [--namespace NS] [--apply]
#
# Writes DIR (default .run/k8s-secrets, git-ignored): the certificate folder,
# secrets.yaml (Namespace + the Secrets, `kubectl create --dry-run=client`:
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
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "k8s_secrets.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-$ROOT/.venv/bin/python}"
command -v kubectl >/dev/null || { echo "k8s_secrets.sh: kubectl not found" >&2; exit 2; }

mkdir -p "$OUT"
chmod 700 "$OUT"
OUT="$(cd "$OUT" && pwd)"   # absolute: operator.yaml names its certificate folder
TLS="$OUT/mesh-tls"
(cd "$ROOT" && "$PY" -m services.tools.devcerts --mesh --out "$TLS" >/dev/null)

# The pods' roles. The `admin` certificate (kvmesh admin / top) stays on
# this machine, in $TLS: no pod needs it, so the cluster never holds it.
ROLES=(scheduler gateway engine envoy)
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

ADMIN_TOKEN_FILE="$OUT/admin-token"
if [ -n "${KVMESH_ADMIN_TOKEN:-}" ]; then
  admin_token="$KVMESH_ADMIN_TOKEN"
elif [ -s "$ADMIN_TOKEN_FILE" ]; then
  admin_token="$(cat "$ADMIN_TOKEN_FILE")"
else
  admin_token="kvma-$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')"
  echo "generated admin token (kept in $ADMIN_TOKEN_FILE): $admin_token"
fi
# Kept for `kvmesh admin --token-file` (also when given by the environment).
(umask 077 && printf '%s\n' "$admin_token" > "$ADMIN_TOKEN_FILE")
admin_digest="$(printf '%s' "$admin_token" | "$PY" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
ADMIN_KEYS="$OUT/admin-keys.yaml"
(umask 077 && cat > "$ADMIN_KEYS" <<YAML
# The scheduler's scheduler.admin_keys_file (services/scheduler/admin_api.py):
# entries like scheduler.admin_keys (services/common/config/scheduler.py).
admin_keys:
  - sha256: $admin_digest
    name: ${KVMESH_ADMIN_NAME:-operator}
YAML
)
BATCH_KEY_FILE="$OUT/batch-internal-key"
if [ -n "${KVMESH_BATCH_INTERNAL_KEY:-}" ]; then
  (umask 077 && printf '%s' "$KVMESH_BATCH_INTERNAL_KEY" > "$BATCH_KEY_FILE")
elif [ ! -s "$BATCH_KEY_FILE" ]; then
  (umask 077 && printf 'kvmb-%s' "$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))')" > "$BATCH_KEY_FILE")
fi

cat > "$OUT/operator.yaml" <<YAML
# \`kvmesh --config $OUT/operator.yaml admin|top ...\` on this machine, with
#   kubectl -n $NAMESPACE port-forward pod/kvmesh-scheduler-0 50051 9101
# (+ deploy/kvmesh-gateway 9102 for top's gateway row): one scheduler replica;
# another, forwarded to a port of its own, with admin --scheduler 127.0.0.1:PORT
# (deploy/README.md "Operate it"). Mesh TLS: the
# \`admin\` certificate and the CA below (the scheduler requires both).
scheduler:
  host: 127.0.0.1
  port: 50051
  metrics_port: 9101
gateway:
  metrics_port: 9102
engines:
  # Engine metrics are per pod (not forwarded): top shows them from GetState.
  count: 0
mesh_tls:
  enabled: true
  cert_dir: $TLS
YAML

{
  kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic kvmesh-mesh-tls --namespace "$NAMESPACE" "${tls_args[@]}" \
    --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic kvmesh-api-keys --namespace "$NAMESPACE" \
    --from-file="api-keys.yaml=$KEYS" --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic kvmesh-admin-keys --namespace "$NAMESPACE" \
    --from-file="admin-keys.yaml=$ADMIN_KEYS" --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic kvmesh-batch-key --namespace "$NAMESPACE" \
    --from-file="internal-key=$BATCH_KEY_FILE" --dry-run=client -o yaml
} > "$OUT/secrets.yaml"
chmod 600 "$OUT/secrets.yaml"
printf 'resources:\n  - secrets.yaml\n' > "$OUT/kustomization.yaml"
echo "wrote $OUT/secrets.yaml (kvmesh-mesh-tls, kvmesh-api-keys, kvmesh-admin-keys, kvmesh-batch-key in namespace $NAMESPACE)"
echo "wrote $OUT/operator.yaml (kvmesh admin / top through kubectl port-forward)"

if [ "$APPLY" = 1 ]; then
  kubectl apply -k "$OUT"
fi
