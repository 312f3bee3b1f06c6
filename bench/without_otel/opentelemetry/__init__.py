"""Put first on a consumer's PYTHONPATH by bench_tracing.py: `opentelemetry` fails to import, as without the extra."""

raise ImportError("opentelemetry is hidden from this process: as if the otel extra were not installed")
