"""The batch service, `kvmesh batch`: OpenAI's Files + Batch API as a
service of its own (README "Batch API"). The HTTP handlers (files_api.py,
batches_api.py, callers.py: who calls), its SQLite state, written by this
process alone (store.py, ownership.py), the input check (inputs.py), the
runner (runner.py, batch_run.py, gate.py, pacing.py) that sends each line
through a gateway's HTTP API (submit.py, credential.py) and the output
lines (output.py); server.py assembles them and serves them."""
