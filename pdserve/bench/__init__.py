"""The serving benchmark: a seeded workload (workload), an async streaming client that replays it against a router
(client), the workers' prefix-cache counters (worker_metrics), summaries and comparisons (report), plots (plot) and
a request-rate sweep (sweep)."""
