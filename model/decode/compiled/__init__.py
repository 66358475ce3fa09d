"""The compiled CPU decoder (`decoder.py`): torch.compile'd decode steps and draws, compiled in a child process
(`compile_child.py`), called without dynamo's guard checks (`guard_free.py`), and a linear model's whole step as one
C++ call (`linear_step.py`)."""
