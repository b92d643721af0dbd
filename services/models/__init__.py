"""Local models kvmesh serves and tests with, built without hub access."""
