"""``python -m pagedkv``: the ``pagedkv`` command (``pagedkv.cli``)."""

import sys

from pagedkv.cli import main

sys.exit(main())
