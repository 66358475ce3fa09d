"""The attention kinds, one module per kind behind one contract (`base.py`): `softmax.py`, `linear.py` (with its
feature maps, `feature_maps.py`), `linformer.py`, `hybrid.py`, `reformer/` (the module in `reformer/attention.py`,
its math beside it). `kinds.py` lists the kinds and their options as plain data (no torch); `classes.py` imports a
kind's class when first asked for; `head_shapes.py` splits and merges heads."""
