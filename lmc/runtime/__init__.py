"""`lmc runtime`: the container entrypoint that serves a built artifact.

Modules: startup (find, extract, verify the artifact), server (the HTTP app: assembles the routes and
serves them), lmi_api and openai_api (the routes), core (Runtime: what the routes share), jobs (Job and
the Backend protocol), scheduler (lmc's own backend over worker groups), batching (the bounded queue and
batch cutting), workers (TP process groups), metrics. Imports run one way, in that order (core.py
says how). Nothing here imports torch at module level: only the worker processes do.
"""
