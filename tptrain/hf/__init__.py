"""The transformers backend: tptrain's engine on transformers' modeling code, for model types tptrain does not
implement natively (`pip install "tptrain[hf]"`). The only package of tptrain that imports transformers, and
only imported when that backend is chosen (`tptrain.models.registry.select_backend`): see model.py."""
