"""Diagnostics above the models: the `tptrain plan` dry run, communication and saved-activation accounting."""
