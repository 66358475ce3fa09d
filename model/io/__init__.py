"""A model's files: safetensors model files (`weights.py`), `rnnserve import hf` (`hf_import.py`, the families it
takes in `hf_families.py`), what token ids stand for (`vocabulary.py`) and chat templates (`chat_template.py`)."""
