"""The engine: continuous batching over state slots, on a thread or in a process of its own."""
