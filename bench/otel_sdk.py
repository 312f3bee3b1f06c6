"""Loaded by bench_tracing.py's traced consumer (TASK_HANDLER_MODULES): the SDK, a batch processor, a no-op exporter.

Every span is recorded, batched and handed to an exporter that drops it: the cost of tracing without the network.
"""

from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult


class DroppingExporter(SpanExporter):
    """Takes every batch and keeps nothing."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


_provider = TracerProvider()
_provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
trace.set_tracer_provider(_provider)
