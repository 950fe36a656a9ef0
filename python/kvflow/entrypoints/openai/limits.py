"""The server's default bounds on one request (each has a `serve` flag)."""

DEFAULT_MAX_REQUEST_BYTES = 8 << 20   # --max-request-bytes: larger bodies get 413
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64  # --max-prompts-per-request: prompts in one completion request
