"""`drafttree serve`: an OpenAI-compatible HTTP server over the decoding methods.

protocol.py   request bodies (pydantic), their checks (drafttree.validate), response and error bodies
text.py       token ids → reply text: complete characters only (TextStream), cut at stop strings
scheduler.py  one worker thread that interleaves the rounds of many requests' Sequences, round-robin
app.py        the FastAPI app: /v1/chat/completions, /v1/completions (SSE streaming), /v1/models, /health
cli.py        the `serve` subcommand (uvicorn)
"""

MAX_BODY_BYTES = 1 << 20  # larger request bodies get 413
DEFAULT_MAX_TOKENS = 256  # max_tokens of a request that does not set it (cut to the context left)
