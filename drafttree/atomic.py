"""Writing files so that a reader (or a killed run) never sees half of one.

Everything goes to a hidden temporary file in the same directory (a rename is only atomic within one
file system) and is renamed over the destination once complete; on any error the temporary is removed.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path):
    """A temporary path beside `path` for writers that want a file name (safetensors, savefig, np.savez);
    renamed onto `path` when the block ends without an error, deleted otherwise.

    The temporary keeps `path`'s suffix, because some writers pick the format from it (savefig) or append
    one when it is missing (np.savez)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
