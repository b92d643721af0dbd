"""OpenAI's Files + Batch API on the gateway (README "Batch API"): the HTTP
handlers (files_api.py, batches_api.py), the shared SQLite state
(store.py, ownership.py), the input check (inputs.py), the runner
(runner.py, batch_run.py, execute.py, gate.py, pacing.py) and the output
lines (output.py); service.py assembles them."""
