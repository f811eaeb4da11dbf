"""``python -m hf_noloco.column_launch``: one launch per replica column
(:mod:`hf_noloco.launch.column_launch`)."""

import sys

from hf_noloco.launch.column_launch import main

if __name__ == "__main__":
    sys.exit(main())
