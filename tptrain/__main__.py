"""`python -m tptrain plan|train ...`: the same as the `tptrain` command."""
from tptrain.cli import main

if __name__ == "__main__":  # spawned workers re-import this module as __mp_main__: run nothing then
    raise SystemExit(main())
