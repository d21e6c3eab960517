"""The run dir: append-only events and metrics, and the summary rebuilt from them."""
