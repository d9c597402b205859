"""Where every millisecond goes: the stage vocabulary (stages.py), request timelines,
Prometheus metrics, OpenTelemetry traces, and the request log behind the dashboard."""
