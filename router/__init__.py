"""The router (imported as `pdserve_router`): OpenAI API in front of the workers (see docs/router.md).

app.py (HTTP edge) -> serving.py (one request) -> dispatch.py (route, send, retry, abort) -> pdserve.wire.client;
policies.py (pure routing), prefix_index.py (what each prefill rank caches), workers.py (health, load, KV events;
where they are: pdserve.discovery), migration.py, text_workers.py, openai_schema.py, responses.py, errors.py,
admission.py, metrics.py, config.py (flags derived by pdserve.settings). Tokenization and chat templates: pdserve.text. Never imports torch (tests/test_architecture.py).
"""
