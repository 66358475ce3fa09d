"""Decoding: which decoder runs a model's steps (`choice.py`), the eager, padded and CUDA-graph decoders
(`eager_and_cuda_graphs.py`), the compiled CPU decoder and its parts (`compiled/`), sampling as pure functions
(`sampling.py`), sequential Monte Carlo over rows (`particles.py`) and a plain generation loop (`generate.py`)."""
