"""rnnserve on Ray Serve: the replicas' app, the launcher, the config check, the metrics."""
