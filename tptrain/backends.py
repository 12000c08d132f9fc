"""The model code a model can run on: one list, read by DistributedConfig, select_backend and the CLI.

A leaf that imports nothing, so the torch-free paths (models/registry.py, the CLI's checks) read it as well.
"""

# "native": tptrain's model code; "transformers": transformers' under tptrain's engine (tptrain.hf); "auto": native
# for tptrain's model types, transformers for any other (models/registry.py's select_backend).
BACKENDS = ("auto", "native", "transformers")
