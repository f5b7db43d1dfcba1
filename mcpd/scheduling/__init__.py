"""The scheduler's policies, one noun per file, free of sockets so they can be tested alone:
the job (job), the class queues with aging (class_queues), per-client token buckets
(rate_limiter), the adaptive batching window (batching_window), the degradation ladder
(degradation), deadlines (deadlines) and worker choice (router). mcpd/daemon/scheduler.py wires
them to the sockets."""
