"""rnnserve server: FastAPI app, continuous-batching engine, metrics."""
