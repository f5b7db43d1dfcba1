"""The scheduler process: its socket-free core (core.py, with the parts it hands work to:
dispatch, worker_events, model_versions, status), the loop that owns its sockets (process.py)
and its side of mcpctl (admin.py). Its policies, one noun per file, free of sockets
so they can be tested alone: the job (job), the class queues with aging (class_queues), admission
(admission) with per-client token buckets (rate_limiter, token_bucket), the adaptive batching
window (batching_window), the degradation ladder (degradation, fast_rung), deadlines
(deadlines), known poison requests (poison), a prompt's token ids (prompt_tokens), worker choice
(router), model versions (traffic) and shadow pairs (shadow)."""
