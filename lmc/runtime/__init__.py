"""`lmc runtime`: the container entrypoint that serves a built artifact.

Modules: startup (find, extract, verify the artifact), workers (TP process groups), batching (the
bounded queue and batch cutting), server (HTTP front end), openai_api, metrics. Nothing here imports
torch at module level: only the worker processes do.
"""
