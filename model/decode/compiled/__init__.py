"""The compiled CPU decoder (`decoder.py`: steps and draws routed to compiled graphs, compiled here or adopted from a
child's compile), in parts by job: which graph serves n rows (`routing.py`), each row class's graphs warmed up and
captured (`warm_up.py`), the draw's input layout (`drawing.py`), inductor's and dynamo's options and guard-free
compiled functions (`graphs.py`, `guard_free.py`), a compile's record and which classes it takes (`lifecycle.py`),
the background compile's thread (`background.py`) and child process (`compile_child.py`), and a linear or hybrid
model's whole step as one C++ call (`one_call.py` picks `linear_step.py` or `hybrid_step.py`, which share
`whole_step.py`)."""
