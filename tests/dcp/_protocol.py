"""The ``flashckpt://`` protocol registered with fsspec in the test processes and their
forked workers (the installed package registers it through its ``fsspec.specs`` entry
point; the suite must not depend on which checkout is installed)."""

from __future__ import annotations

import fsspec

fsspec.register_implementation("flashckpt", "flashckpt.dcp._fs.FlashFileSystem", clobber=True)
