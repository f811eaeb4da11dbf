"""Where things are: the repository's root, and this folder (scripts the tests run as processes)."""

import os

HELPERS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HELPERS))
