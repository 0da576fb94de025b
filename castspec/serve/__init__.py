"""The OpenAI-compatible server: protocol types, the app, the engine loop that steps the batch, Prometheus
metrics, and Ray Serve replicas."""
