"""`kvmesh bench`: a seeded load generator for any OpenAI-compatible endpoint
(kvmesh, another router, a single engine). See services/bench/cli.py."""
