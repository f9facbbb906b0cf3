"""The Tornado service: HTTP edge, schema validation, JSON/SSE rendering."""
