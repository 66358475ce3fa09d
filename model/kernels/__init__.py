"""The C++ kernels of CPU decode steps (the .cpp and .h sources in this folder), built and registered by
`loader.py`; the CPU's vector instructions (`cpu_features.py`), intra-op threads (`threads.py`) and each model's
decode twin on packed weights (`packed_linear.py`)."""
