"""Reformer LSH attention's math, one module per job (the nn.Module is model/attention/reformer/attention.py):

- `visibility`: which keys a query sees and how rounds combine, the one definition;
- `hashing`: rotations and buckets, in float32;
- `dense`: the reference form over explicit keys (chunks after a cache);
- `bucketed`: whole sequences inside sorted, padded buckets, and the local round in blocks;
- `causal`: whole sequences with one hashed round as a single causal attention call;
- `decode`: the cache and its chunk and single-token steps.
"""
