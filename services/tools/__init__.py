"""Tools run by developers and operators, not services of the mesh.

`protogen` regenerates the gRPC stubs and Envoy's descriptor set from
protos/ (`make protos`); `devcerts` writes development TLS certificates for
Envoy's public listener and for the mesh's mutual TLS. Nothing in a running
service imports this package except the launcher, which makes development
certificates on start-up when no certificate of the operator's own is given.
"""
