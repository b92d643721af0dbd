"""The Kubernetes manifests (deploy/), offline: every overlay renders with
`kubectl kustomize`, every object validates against the Kubernetes API's
schemas (and the vendored CRD schemas), and what the manifests run matches
the code -- commands, env, config, ports, probes, drain, Envoy, policies."""
