"""Training, evaluation, data loading and pictures for rnnserve models."""
